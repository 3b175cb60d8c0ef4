"""The FastAPI application: SGLang's native routes, error handling, API-key check, lifespan.

OpenAI routes live in openai_api.py (/v1/responses in responses_api.py); the engine thread bridge in async_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from hybridmoe.config import EngineArgs, ServerConfig
from hybridmoe.engine.engine import Engine, RequestError
from hybridmoe.server import info_routes, lora_routes, openai_api, responses_api
from hybridmoe.server.async_engine import AsyncEngine, EngineFailed, RequestStream, Unavailable
from hybridmoe.server.connections import RequestLimitsMiddleware
from hybridmoe.server.errors import APIError, ParamNames, error_body, error_response, install_error_handlers
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.metrics import CONTENT_TYPE, ServerMetrics
from hybridmoe.server.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    check_top_logprobs,
    max_top_logprobs_num,
)
from hybridmoe.server.sampling_defaults import GENERATION_CONFIG, load_sampling_defaults
from hybridmoe.server.state import ReqSpec, ServerState
from hybridmoe.server.streaming import DONE, CumulativeEvents, guarded_all, merged, results, sse, visible_text

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


class APIKeyMiddleware:
    """Pure ASGI (streams and disconnect detection pass through untouched): `Authorization: Bearer
    <key>` on every route except /health*, /metrics and CORS pre-flight. The scheme is
    case-insensitive (RFC 9110); the key is compared in constant time."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, key = header.strip().partition(b" ")
        # compare_digest runs on every request, so a wrong scheme takes as long as a wrong key
        ok_key = hmac.compare_digest(key.strip(), self.expected)
        return scheme.lower() == b"bearer" and ok_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or path.startswith("/health") \
                or path == "/metrics":
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if self._authorized(got):
            return await self.app(scope, receive, send)
        response = JSONResponse(error_body(401, "missing or wrong API key: send 'Authorization: Bearer <key>'"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class JSONBodyMiddleware:
    """Treat a POST body sent without a JSON content type (`curl -d '{...}'` sends
    application/x-www-form-urlencoded) as JSON, as SGLang's server does; a body that is not JSON
    still fails validation with a message that says so."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            ctype = dict(scope.get("headers") or []).get(b"content-type", b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded") or ctype.startswith(b"text/plain"):
                scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    install_error_handlers(app)  # APIError, validation, 404/405 and unhandled errors: errors.py

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, e: Unavailable) -> JSONResponse:
        return JSONResponse(error_body(503, str(e)), status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(EngineFailed)
    async def _failed(_: Request, e: EngineFailed) -> JSONResponse:
        return error_response(500, str(e))


class _OffLoopJSONRequest(Request):
    """A request whose JSON body is parsed by the server's worker pool when it is large."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            state: ServerState = self.app.state.hybridmoe
            self._json = await state.pool.parse_json(await self.body())
        return self._json


# A JSON body at least this large is validated against its route's model in a thread: pydantic took ~1.2-1.6 s
# for a 6.5 MiB chat body of 200,000 messages (2-core Zen 4), the event loop, so every stream, stopped meanwhile
# (its longest tick 1222 ms); from a thread the loop's longest tick was 94 ms (the GIL's switch interval between).
OFF_LOOP_VALIDATE_BYTES = 256 << 10


def _validated(model: type[BaseModel], data: Any) -> BaseModel:
    """model_validate(data); a failure as FastAPI reports it (RequestValidationError, locations under "body")."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=data) from None


class OffLoopJSONRoute(APIRoute):
    """FastAPI's route with `_OffLoopJSONRequest` (FastAPI's extension point for request parsing); a large JSON
    body of a route with one model body is parsed and validated off the event loop before FastAPI sees it. FastAPI
    then takes the model instance as it is (pydantic does not revalidate instances), so its own validation on the
    loop costs nothing."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        field = self.body_field
        model = getattr(field, "field_info", None) and field.field_info.annotation  # type: ignore[union-attr]
        model = model if isinstance(model, type) and issubclass(model, BaseModel) else None

        async def route(request: Request) -> Response:
            req = _OffLoopJSONRequest(request.scope, request.receive, request._send)
            if model is not None and req.headers.get("content-type", "").startswith("application/json"):
                body = await req.body()
                if len(body) >= OFF_LOOP_VALIDATE_BYTES:
                    try:
                        data = await req.json()
                    except Exception:  # noqa: BLE001  (not JSON: FastAPI parses it again and reports it as usual)
                        pass
                    else:
                        req._json = await asyncio.to_thread(_validated, model, data)
            return await handler(req)

        return route


def _batch_size(body: GenerateRequest) -> int | None:
    """None for one prompt, else the batch size."""
    if isinstance(body.text, list):
        return len(body.text)
    if body.input_ids and isinstance(body.input_ids[0], list):
        return len(body.input_ids)
    return None


def _check_batch_size(state: ServerState, n: int, param: str) -> None:
    """400 for a /tokenize or /detokenize batch of more inputs than --max-sequences-per-request. Each input was
    one job handed off the event loop, and the loop's share of a job (~0.1 ms) added up: a 2.5 MB body of
    500,000 one-character prompts held the loop, so every request of the server, for over a minute. A batch is
    a few jobs now (workers.batch_chunks), and this bound keeps the rest of its per-input work (the response's
    lists, the id range check) bounded too."""
    limit = state.limits.max_sequences_per_request
    if n > limit:
        raise APIError(400, f"the batch has {n} inputs; this server's limit is {limit} per request "
                            "(--max-sequences-per-request raises it)", param=param)


def _native_names(body: GenerateRequest, i: int | None = None) -> ParamNames:
    """How /generate names the engine's fields for one prompt (i: its index in a batch): its own paths, with the
    index where a field holds one value per prompt (`input_ids.3`, `sampling_params.3.top_k`, `lora_path.3`)."""
    def at(name: str) -> str:
        return f"{name}.{i}" if i is not None and isinstance(getattr(body, name), list) else name

    prompt = "text" if body.text is not None else "input_ids"
    return ParamNames(prompt if i is None else f"{prompt}.{i}", at("sampling_params") + ".",
                      {name: at(name) for name in ("top_logprobs_num", "logprob_start_len", "lora_path", "rid")})


def _pick(value: Any, i: int, n: int, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != n:
            raise APIError(400, f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value[i]
    return value


async def _generate_events(streams: list[RequestStream], stops: list[str]) -> AsyncIterator[bytes]:
    events = [CumulativeEvents() for _ in streams]  # each logprob entry encoded once per stream
    try:
        async for i, out in merged(streams):  # n > 1: each event carries its sequence's index
            yield events[i].event(dict(out, text=visible_text(out, stops), index=i) if len(streams) > 1 else
                                  dict(out, text=visible_text(out, stops)))
    except EngineFailed as e:
        yield sse(error_body(500, str(e)))
    yield DONE


def _register_native_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 once the model is loaded and the server takes requests, else 503."""
        state.engine.check_available()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 when the engine generates one token within the time limit."""
        # min_new_tokens too: --preferred-sampling-params go under these, and one above 1 was a 400 on every probe
        req = await state.build_req(input_ids=[0], params={"max_new_tokens": 1, "min_new_tokens": 0, "temperature": 0.0},
                                    rid=f"health-{uuid.uuid4().hex}")
        stream = state.submit([req])[0]
        try:
            await asyncio.wait_for(stream.result(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            state.engine.abort(req.rid, "health check timed out")
            raise Unavailable("the engine did not generate a token in time") from None
        return Response(status_code=200)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """SGLang's native generation: text or input_ids, one prompt or a batch."""
        n = _batch_size(body)

        def logprobs(i: int) -> dict[str, Any]:  # prompt i's logprob options (one prompt: i = 0, n = None)
            def pick(name: str) -> Any:
                value = getattr(body, name)
                if n is None and isinstance(value, list):
                    raise APIError(400, f"{name} is a list, but the request has one prompt", param=name)
                return _pick(value, i, n or 1, name)

            want, top = pick("return_logprob"), pick("top_logprobs_num")
            check_top_logprobs(top, "top_logprobs_num", max_top_logprobs_num(state))
            return dict(return_logprob=want, top_logprobs_num=top,
                        logprob_start_len=pick("logprob_start_len") if want else -1,
                        return_text_in_logprobs=body.return_text_in_logprobs)

        if n is None:
            if isinstance(body.lora_path, list):
                raise APIError(400, "lora_path is a list; one prompt takes one adapter name", param="lora_path")
            req = await state.build_req(prompt=body.text, input_ids=body.input_ids, params=body.sampling_params,
                                        rid=body.rid, lora_path=body.lora_path, names=_native_names(body), **logprobs(0))
            streams = state.submit([req])  # n > 1 (sampling_params.n): n streams, n outputs in a list
            if body.stream:
                events = _generate_events(streams, req.params.stop_strs)
                return StreamingResponse(guarded_all(streams, state.engine, events), media_type="text/event-stream")
            outs = await results(request, state.engine, streams)
            return outs if len(outs) > 1 else outs[0]
        if body.stream:
            raise APIError(400, "stream=true takes one prompt, not a batch", param="stream")
        if n == 0:
            raise APIError(400, "the batch is empty")
        texts = body.text if isinstance(body.text, list) else None
        ids = body.input_ids if texts is None else None
        if texts is not None and body.input_ids is not None:
            raise APIError(400, "give exactly one of `text` and `input_ids`")
        state.check_sequences([(p or {}).get("n") if isinstance(p, dict) else None
                               for p in (_pick(body.sampling_params, i, n, "sampling_params") for i in range(n))])
        # one build for the batch: its texts tokenized in a few jobs, not one a prompt (see ServerState.build_reqs)
        specs = [ReqSpec(prompt=texts[i] if texts is not None else None,
                         input_ids=ids[i] if ids is not None else None,  # type: ignore[index]
                         params=_pick(body.sampling_params, i, n, "sampling_params"),
                         rid=_pick(body.rid, i, n, "rid"), lora_path=_pick(body.lora_path, i, n, "lora_path"),
                         names=_native_names(body, i), **logprobs(i)) for i in range(n)]
        reqs = await state.build_reqs(specs, "text" if texts is not None else "input_ids")
        return await results(request, state.engine, state.submit(reqs))

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return info_routes.model_info(state)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return state.server_info()

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """Forget the prefix cache; refused (400) while requests are in flight."""
        if not await state.engine.call(Engine.flush_cache):
            raise APIError(400, "cannot flush the cache while requests are running; retry when idle")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        """Abort one request by rid (or all); unknown rids are ignored."""
        if body.abort_all:
            state.engine.abort_all("aborted by /abort_request")
        elif body.rid:
            state.engine.abort(body.rid, "aborted by /abort_request")
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """Token ids of a prompt (or a batch, in a few jobs), off the event loop; beyond the context length: 400
        naming the prompt (`prompt.3` in a batch)."""
        ctx = state.core.context_len
        if isinstance(body.prompt, str):
            ids = await state.encode(body.prompt, "prompt", body.add_special_tokens)
            return {"tokens": ids, "count": len(ids), "max_model_len": ctx}
        _check_batch_size(state, len(body.prompt), "prompt")
        all_ids = await state.encode_batch(body.prompt, [f"prompt.{i}" for i in range(len(body.prompt))], "prompt",
                                           body.add_special_tokens)
        return {"tokens": all_ids, "count": [len(x) for x in all_ids], "max_model_len": ctx}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """Text of token ids (or a batch), off the event loop."""
        state.tokenizer()
        vocab = state.core.hf_config.vocab_size
        batch = bool(body.tokens) and isinstance(body.tokens[0], list)
        seqs: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment,list-item]
        _check_batch_size(state, len(seqs), "tokens")
        for i, seq in enumerate(seqs):
            if seq and (min(seq) < 0 or max(seq) >= vocab):  # min/max: C speed on a long list
                where = f"tokens.{i}" if batch else "tokens"
                raise APIError(400, f"{where} must be ids in [0, {vocab})", param=where)
        if not batch:
            return {"text": await state.decode(seqs[0], body.skip_special_tokens)}
        return {"text": await state.decode_batch(seqs, body.skip_special_tokens, "tokens")}

    if state.server_config.enable_metrics and state.metrics is not None:
        metrics = state.metrics

        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(metrics.render(), media_type=CONTENT_TYPE)


def create_app(args: EngineArgs, engine_factory: Callable[[EngineArgs], Engine] | None = None,
               limits: ServerLimits | None = None, server: ServerConfig | None = None,
               freeze_gc: bool = False) -> FastAPI:
    """The application; the engine thread starts (and loads the model) with the app's lifespan.

    limits: the server's limits (defaults when None); kept at app.state.hybridmoe.limits.
    server: the server's own settings (API key, metrics, queue bound; defaults when None).
    freeze_gc: once the model has loaded, collect and then freeze every object alive (gc.freeze): the
    process's own server (run_server) does; an app in a test process leaves that process's collector alone.
    """
    server = server or ServerConfig()
    model_name = args.served_model_name or args.model_path
    metrics = ServerMetrics(model_name)  # cheap; exposed at /metrics only with --enable-metrics
    engine = AsyncEngine(args, metrics, engine_factory, max_queued_requests=server.max_queued_requests)
    sampling = load_sampling_defaults(args.model_path, server.sampling_defaults, server.preferred_sampling_params)
    if sampling.chat:
        log.info("chat routes' default sampling values, from the model's %s: %s (--sampling-defaults openai: "
                 "the built-in ones)", GENERATION_CONFIG, sampling.chat)
    state = ServerState(args=args, engine=engine, metrics=metrics, model_name=model_name,
                        limits=limits or ServerLimits(), server_config=server, freeze_gc=freeze_gc, sampling=sampling)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        watcher = asyncio.ensure_future(_watch_load(state))
        yield
        watcher.cancel()
        if state.engine.load_error is not None:  # also when shutdown came before the watcher saw the failure
            state.exit_code = 1
        state.engine.draining = True
        # each shutdown step runs even if one before it failed; a failure is one warning line (seen once
        # in CI: uvicorn's "Application shutdown failed" with a traceback after a SIGTERM mid-stream)
        # abort on the loop (request streams belong to it), then the blocking steps (joins) off it
        steps = (("abort the requests in flight", False, lambda: state.engine.abort_all("the server is shutting down")),
                 ("stop the engine", True, state.engine.stop), ("stop the tokenizer workers", True, state.pool.close))
        for name, blocking, step in steps:
            try:
                await asyncio.to_thread(step) if blocking else step()
            except Exception as e:  # noqa: BLE001  (shutdown goes on)
                log.warning("shutdown: could not %s: %s: %s", name, type(e).__name__, e)

    app = FastAPI(title="hybridmoe", version="0.1.0", lifespan=lifespan)
    app.state.hybridmoe = state
    app.router.route_class = OffLoopJSONRoute  # before any route is added
    _install_error_handlers(app)
    _register_native_routes(app, state)
    openai_api.register_routes(app, state)
    responses_api.register_routes(app, state)  # /v1/responses, on the chat routes' machinery
    info_routes.register_routes(app, state)
    lora_routes.register_routes(app, state)
    _answer_head(app)
    app.add_middleware(JSONBodyMiddleware)
    if server.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.api_key)
    if server.allowed_origins:  # CORS (off by default); outside the API key check: pre-flights carry no key
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(server.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in server.allowed_origins)
    app.add_middleware(RequestLimitsMiddleware, limits=state.limits)  # outermost: sizes and times first
    return app


def _answer_head(app: FastAPI) -> None:
    """HEAD on every GET-only route, as RFC 9110 (9.3.2) asks of a server that takes GET: FastAPI's routes take only
    the methods they are declared with, so a load balancer or monitor probing `HEAD /health` got 405. A twin route
    kept out of the OpenAPI schema (adding HEAD to the route itself gives two operations one id there); uvicorn
    sends no body for HEAD. Routes declared GET and POST (/flush_cache, the expert record) change state: no HEAD."""
    for route in list(app.router.routes):
        if isinstance(route, APIRoute) and route.methods == {"GET"}:
            app.router.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                                     response_model=None, name=f"{route.name}_head")


def freeze_loaded_objects() -> int:
    """Collect, then move every object alive (the model's modules, the tokenizer, the libraries: ~366,000 with
    the demo model) out of the collector's reach; the number frozen. A full collection walks them all: ~180 ms
    with the demo model loaded (2-core machine), the GIL held meanwhile, so every stream and the engine's step
    stalled whenever the oldest generation filled up. Objects made later (requests) are collected as before;
    frozen ones are still freed by their reference counts."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("garbage collector: %d objects alive after the load frozen (full collections no longer walk them)", n)
    return n


async def _watch_load(state: ServerState) -> None:
    """Stop the server (exit code 1) if the model fails to load."""
    ok = await asyncio.to_thread(state.engine.wait_loaded)
    if ok and state.freeze_gc:
        await asyncio.to_thread(freeze_loaded_objects)
    if ok and state.engine.engine is not None:
        state.pool.start(state.engine.engine.tokenizer)  # workers load while the first requests come
    if not ok:
        state.exit_code = 1
        if state.server is not None:
            state.server.should_exit = True
