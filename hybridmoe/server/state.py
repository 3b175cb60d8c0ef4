"""What every route needs: the options, the engine bridge, metrics, and request construction."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridmoe.config import EngineArgs, ServerConfig
from hybridmoe.engine.engine import Engine, RequestError
from hybridmoe.engine.grammar import grammar_of
from hybridmoe.engine.request import Req
from hybridmoe.server.async_engine import AsyncEngine, RequestStream
from hybridmoe.server.errors import NATIVE_TEXT, APIError, ParamNames
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.metrics import ServerMetrics
from hybridmoe.server.sampling_defaults import SamplingDefaults
from hybridmoe.server.structured import attach_grammar
from hybridmoe.server.templates import model_template
from hybridmoe.server.workers import BatchItemError, PromptTooLong, TokenizerPool

CLIENT_TEMPLATE = "chat_template_kwargs.chat_template"
INLINE_REQUESTS = 16  # batches up to this size make their requests on the event loop (a thread hop costs more)


@dataclass
class ReqSpec:
    """One request of build_reqs: build_req's arguments. names: how the route names the engine's fields."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    params: dict[str, Any] | None = None
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    lora_path: str | None = None
    check_max_tokens: bool = True
    names: ParamNames = NATIVE_TEXT


@dataclass
class ServerState:
    args: EngineArgs
    engine: AsyncEngine
    metrics: ServerMetrics | None
    model_name: str
    server: Any = None  # the uvicorn.Server, to stop it if the model fails to load
    exit_code: int = 0
    limits: ServerLimits = field(default_factory=ServerLimits)
    server_config: ServerConfig = field(default_factory=ServerConfig)
    pool: TokenizerPool = None  # type: ignore[assignment]  # made from limits
    freeze_gc: bool = False  # app.create_app's: gc.freeze once the model has loaded
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # put under each request's own values

    def __post_init__(self) -> None:
        if self.pool is None:
            self.pool = TokenizerPool(self.limits)

    def _pool(self) -> TokenizerPool:
        """The tokenizer pool, started on first use (the engine is up by then)."""
        if not self.pool.started:
            self.pool.start(self.core.tokenizer)
        return self.pool

    async def encode(self, text: Any, field: str = "text", add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, off the event loop; 400 naming the context length when too long."""
        if not isinstance(text, str):
            raise APIError(400, f"{field} must be a string", param=field)
        ctx = self.core.context_len
        limit = None if self.args.allow_auto_truncate else ctx  # --allow-auto-truncate: the engine cuts it
        try:
            return await self._pool().encode(text, add_special_tokens=add_special_tokens, max_len=limit, field=field)
        except PromptTooLong as e:
            raise APIError(400, f"the prompt has {e.n} tokens; the context length is {ctx}", param=field) from None

    async def decode(self, ids: list[int], skip_special_tokens: bool = True, field: str = "tokens") -> str:
        return await self._pool().decode(ids, skip_special_tokens=skip_special_tokens, field=field)

    async def encode_batch(self, texts: list[Any], params: list[str], field: str,
                           add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of a batch's prompts in a few pool jobs (not one per prompt: each job costs the event loop
        its share, which a batch of thousands made a stall of the whole server); a 400 names the prompt's own
        param (params[i], e.g. `prompt.3`), with the context length when it is too long. field: the batch's
        field, named when a whole job fails (a timeout)."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise APIError(400, f"{params[i]} must be a string", param=params[i])
        ctx = self.core.context_len
        limit = None if self.args.allow_auto_truncate else ctx  # --allow-auto-truncate: the engine cuts it
        try:
            return await self._pool().encode_batch(texts, add_special_tokens=add_special_tokens, max_len=limit,
                                                   field=field)
        except PromptTooLong as e:
            where = params[e.index or 0]
            raise APIError(400, f"{where}: the prompt has {e.n} tokens; the context length is {ctx}",
                           param=where) from None
        except BatchItemError as e:
            raise APIError(400, f"{params[e.index]}: {e.message}", param=params[e.index]) from None

    async def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True,
                           field: str = "tokens") -> list[str]:
        """Text of a batch of id lists in a few pool jobs (see encode_batch); a 400 names `field.<index>`."""
        try:
            return await self._pool().decode_batch(seqs, skip_special_tokens=skip_special_tokens, field=field)
        except BatchItemError as e:
            raise APIError(400, f"{field}.{e.index}: {e.message}", param=f"{field}.{e.index}") from None

    async def chat_prompt_ids(self, messages: list[dict[str, Any]], continue_final_message: bool,
                              chat_template_kwargs: dict[str, Any] | None) -> list[int]:
        """Render the chat template (sandboxed, time-limited, in a worker) and tokenize the prompt.

        A client's own template (chat_template_kwargs.chat_template) is refused unless the server
        runs with --allow-client-chat-template.
        """
        variables = dict(chat_template_kwargs or {})
        source = variables.pop("chat_template", None)
        if source is not None:
            if not self.limits.allow_client_chat_template:
                raise APIError(400, f"{CLIENT_TEMPLATE}: a client's chat template is refused by this server "
                                    "(it runs with the model's; start it with --allow-client-chat-template to "
                                    "accept one)", param=CLIENT_TEMPLATE)
            if not isinstance(source, str) or not source:
                raise APIError(400, f"{CLIENT_TEMPLATE} must be a non-empty string", param=CLIENT_TEMPLATE)
        elif model_template(self.tokenizer()) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        ctx = self.core.context_len
        try:
            return await self._pool().chat_ids(messages, source=source, add_generation_prompt=not continue_final_message,
                                               continue_final_message=continue_final_message, variables=variables,
                                               max_len=None if self.args.allow_auto_truncate else ctx)
        except PromptTooLong as e:
            raise APIError(400, f"the prompt has {e.n} tokens; the context length is {ctx}",
                           param="messages") from None

    @property
    def core(self) -> Engine:
        """The Engine (only its thread-safe parts may be used here: make_request, tokenizer, config)."""
        self.engine.check_available()
        assert self.engine.engine is not None
        return self.engine.engine

    def check_model(self, model: str | None) -> str | None:
        """An OpenAI `model` field must name this server's model, "<model>:<adapter>" or "<adapter>" (a
        loaded LoRA adapter); returns the adapter's name (None: the base model)."""
        from hybridmoe.server.lora_routes import model_adapter

        return model_adapter(self, model, self.base_names())

    def base_names(self) -> tuple[str, ...]:
        """The names an OpenAI `model` field may give the base model (an adapter cannot take one)."""
        return self.model_name, self.args.model_path, Path(self.args.model_path).name, "default"

    def tokenizer(self):
        tok = self.core.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send and receive token ids")
        return tok

    def check_sequences(self, counts: list[Any]) -> None:
        """A request's prompts, each with its n (None or a non-int: 1, left to the request's own checks): 400
        when they start more sequences than --max-sequences-per-request, before anything is tokenized."""
        total = sum(n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1 for n in counts)
        limit = self.limits.max_sequences_per_request
        if total > limit:
            raise APIError(400, f"the request starts {total} sequences (prompts times n); this server's limit is "
                                f"{limit} (--max-sequences-per-request raises it)")

    async def build_req(self, *, prompt: str | None = None, input_ids: list[int] | None = None,
                        params: dict[str, Any] | None = None, rid: str | None = None, return_logprob: bool = False,
                        top_logprobs_num: int = 0, check_max_tokens: bool = True, logprob_start_len: int = -1,
                        return_text_in_logprobs: bool = False, lora_path: str | None = None,
                        names: ParamNames = NATIVE_TEXT) -> Req:
        """Validate and tokenize one request (tokenization off the event loop); APIError(400) with
        the engine's message when bad, its `param` the field as the route names it (names).

        An explicit max_new_tokens that does not fit in the context with the prompt is an error
        (the engine would silently shorten it).
        """
        spec = ReqSpec(prompt=prompt, input_ids=input_ids, params=params, rid=rid, return_logprob=return_logprob,
                       top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
                       return_text_in_logprobs=return_text_in_logprobs, lora_path=lora_path,
                       check_max_tokens=check_max_tokens, names=names)
        return (await self.build_reqs([spec]))[0]

    async def build_reqs(self, specs: list[ReqSpec], batch_field: str | None = None) -> list[Req]:
        """build_req for a batch, with O(1) event-loop work per batch where it matters: the text prompts are
        tokenized in a few pool jobs (encode_batch) and a large batch's requests are made (Engine.make_request,
        thread-safe) in one thread job, so a batch of thousands does not hold every other request of the server.
        The first bad prompt (in order) is the 400, named by its spec's names. batch_field: the batch's prompt field."""
        engine = self.core
        preferred = self.sampling.preferred
        from_flag: list[set[str]] = []  # per spec: the parameters --preferred-sampling-params gave it
        for spec in specs:
            own = spec.params
            from_flag.append(set(preferred) - set(own) if isinstance(own, dict) else set(preferred) if own is None
                             else set())
            spec.params = self.sampling.for_request(own)  # --preferred-sampling-params under its own
            self._check_spec(spec)
        texts = [i for i, spec in enumerate(specs) if spec.prompt is not None]
        if len(specs) == 1 and texts:
            spec = specs[0]
            spec.input_ids = await self.encode(spec.prompt, spec.names.prompt)
        elif texts:
            all_ids = await self.encode_batch([specs[i].prompt for i in texts], [specs[i].names.prompt for i in texts],
                                              batch_field or specs[texts[0]].names.prompt)
            for i, ids in zip(texts, all_ids):
                specs[i].input_ids = ids

        def make_all() -> list[Req]:
            out = []
            for spec, flagged in zip(specs, from_flag):
                try:
                    out.append(engine.make_request(
                        input_ids=spec.input_ids, sampling_params=spec.params, rid=spec.rid,
                        return_logprob=spec.return_logprob, top_logprobs_num=spec.top_logprobs_num,
                        logprob_start_len=spec.logprob_start_len, return_text_in_logprobs=spec.return_text_in_logprobs,
                        lora_path=spec.lora_path))
                except RequestError as e:
                    err = spec.names.error(e)
                    if e.field in flagged:  # the client never sent it: say where it came from
                        err = APIError(400, f"{err.message} ({e.field} is the server's --preferred-sampling-params "
                                            f"value)", param=err.param)
                    raise err from e
            return out

        # a few requests: made here; a batch: on a thread, as each takes tens of microseconds of Python
        reqs = make_all() if len(specs) <= INLINE_REQUESTS else await asyncio.to_thread(make_all)
        graded = [(req, spec) for req, spec in zip(reqs, specs) if grammar_of(req.params) is not None]
        if graded:  # structured output: compiled off the event loop, 400 if it fails (cached: a batch compiles once)
            await asyncio.gather(*(attach_grammar(self, req, spec.names) for req, spec in graded))
        ctx = engine.context_len
        for req, spec in zip(reqs, specs):
            wanted = (spec.params or {}).get("max_new_tokens")
            if spec.check_max_tokens and not self.args.allow_auto_truncate and isinstance(wanted, int) \
                    and wanted + len(req.prompt_ids) > ctx:
                param = spec.names("max_new_tokens")  # max_tokens (OpenAI), sampling_params.max_new_tokens
                name = (param or "max_new_tokens").rsplit(".", 1)[-1]
                raise APIError(400, f"{name}={wanted} plus the prompt's {len(req.prompt_ids)} tokens exceed the "
                                    f"context length {ctx}", param=param)
        return reqs

    def _check_spec(self, spec: ReqSpec) -> None:
        """What build_reqs checks before tokenizing: one prompt, sampling_params an object, n within the limit."""
        if spec.params is not None and not isinstance(spec.params, dict):
            raise APIError(400, "sampling_params must be an object", param=spec.names.sampling.rstrip(".") or None)
        if (spec.prompt is None) == (spec.input_ids is None):
            raise APIError(400, "give exactly one of `text` (prompt) and `input_ids`")
        n = (spec.params or {}).get("n")
        if isinstance(n, int) and n > self.limits.max_n_samples:
            raise APIError(400, f"n={n} is above this server's limit of {self.limits.max_n_samples} samples per "
                                "prompt (--max-n-samples raises it)", param=spec.names("n"))
        self.check_sequences([n])  # (a batch's total was checked before its prompts were tokenized)

    def submit(self, reqs: list[Req]) -> list[RequestStream]:
        """Queue requests; all or none (503 past the queue bound, 400 on a duplicate rid).

        One stream per sequence: a request with n > 1 gives n streams in a row (its forks after it).
        """
        streams: list[RequestStream] = []
        try:
            for req in reqs:
                forks = [f.rid for f in req.forks]
                streams.append(self.engine.submit(req))
                streams.extend(self.engine.stream_of(rid) for rid in forks)
        except ValueError as e:
            self._abort(streams)
            raise APIError(400, str(e), param="rid") from e
        except BaseException:
            self._abort(streams)
            raise
        return streams

    def _abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.engine.abort(s.rid, "a request of the same batch was refused")

    def server_info(self) -> dict[str, Any]:
        """Options (API key redacted) and the engine's internal state."""
        info = {**dataclasses.asdict(self.args), **dataclasses.asdict(self.server_config)}
        if info.get("api_key"):
            info["api_key"] = "<redacted>"
        from hybridmoe import __version__

        stats = dict(self.engine.stats)
        info.update(stats)
        info.update({"version": __version__, "served_model_name": self.model_name, "ready": self.engine.ready,
                     "num_queued_streams": self.engine.num_queued, "internal_states": [stats]})
        if self.engine.engine is not None:
            info["context_length"] = self.engine.engine.context_len
        return info
