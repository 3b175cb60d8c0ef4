"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (streamed or not), and the chat
machinery /v1/responses (responses_api.py) is built on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from hybridmoe.engine.grammar import grammar_of
from hybridmoe.engine.request import Req
from hybridmoe.server.async_engine import EngineFailed, RequestStream
from hybridmoe.server.chat_tools import ChatPlan, plan_chat, prompt_tail, template_message, template_tools
from hybridmoe.server.errors import APIError, ParamNames, error_body
from hybridmoe.server.lora_routes import adapter_cards
from hybridmoe.server.parsers.chat_output import ChatOutput
from hybridmoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_top_logprobs,
    max_top_logprobs_num,
)
from hybridmoe.server.state import ReqSpec, ServerState
from hybridmoe.server.streaming import DONE, guarded_all, merged, results, sse, visible_text
from hybridmoe.server.structured import grammar_fields, structured_params

# The engine's (SGLang's) names of fields an OpenAI request spells otherwise, for an error's `param`; each route
# adds its own (max_tokens or max_completion_tokens, logprobs or top_logprobs, the grammar's field).
_OPENAI_RENAMES = {"min_new_tokens": "min_tokens", "sampling_seed": "seed", "lora_path": "model"}


def request_adapters(from_model: str | None, body: SamplingFields,
                     prompts: int | None = None) -> list[tuple[str | None, str]]:
    """The LoRA adapter of each prompt (one: prompts None) and the field that named it, for an error's `param`
    (`model`, `lora_path`, `lora_path.<i>`). from_model: the adapter `model` names ("<served>:<adapter>", checked
    by ServerState.check_model: 404 naming `model`); SGLang's `lora_path` names one as /generate's does (checked by the engine: 400 naming
    `lora_path`), on /v1/completions possibly a list of one per prompt (null: the base model). Both given must
    agree: a 400 naming both where they do not (SGLang lets `model` win silently; a request that asks for two
    adapters is answered, not guessed)."""
    lora = body.lora_path
    if lora is None:
        return [(from_model, "model")] * (prompts or 1)
    if isinstance(lora, list):
        if prompts is None:
            raise APIError(400, "lora_path is a list; one prompt takes one adapter name", param="lora_path")
        if len(lora) != prompts:
            raise APIError(400, f"lora_path has {len(lora)} entries for {prompts} prompts", param="lora_path")
        named = [(name, f"lora_path.{i}") for i, name in enumerate(lora)]
    else:
        named = [(lora, "lora_path")] * (prompts or 1)
    if from_model is not None:
        for name, param in named:
            if name != from_model:
                asked = "the base model" if name is None else f"the LoRA adapter {name[:200]!r}"
                raise APIError(400, f"model {body.model!r} asks for the LoRA adapter {from_model!r} but {param} "
                                    f"asks for {asked}; name the adapter in one of them, or the same in both",
                               param=param)
    return named


def _sampling(body: SamplingFields, max_new_tokens: int) -> dict[str, Any]:
    """OpenAI fields -> SGLang sampling parameters (the engine validates them again, against the
    vocabulary); a field left out or null keeps SamplingParams' default."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "min_new_tokens": body.min_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens,
        "no_stop_trim": body.no_stop_trim, "n": body.n, "sampling_seed": body.seed}
    params.update(structured_params(body))  # response_format / json_schema / regex / ebnf, logit_bias
    return {k: v for k, v in params.items() if v is not None}


def _finish(out: dict[str, Any]) -> tuple[str | None, Any]:
    """(OpenAI finish_reason, matched stop) of an output."""
    reason = out["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


# Aborts the engine ends a request with because something failed (Engine._fail_request / _fail_culprit: "request
# failed: ...", _fail_batch and the engine thread: "engine failure: ...", the scheduler's refusals of a request too
# large for the KV cache). SGLang's OpenAI routes answer such an abort (one with a status) as an error, not a
# choice; the server's own aborts (an operator's /abort_request, shutdown, a client gone) stay finish_reason
# "abort", as SGLang's do.
_FAILED = ("request failed:", "engine failure", "KV cache too small", "request of ")
_REQUESTS_OWN = ("GrammarError", "KV cache too small", "request of ")  # the request cannot be served as given


def _abort_error(out: dict[str, Any], grammar_param: str | None) -> APIError | None:
    """The error an output that ended in a failure abort is answered with (None for any other output): the
    engine's status (500 for an engine failure), else 400 when the request itself is at fault (its grammar
    allowed no token: `param` names the grammar's field, grammar_param; too large for the KV cache), else 500."""
    reason = out["meta_info"]["finish_reason"]
    if not reason or reason.get("type") != "abort":
        return None
    message = str(reason.get("message") or "the request was aborted")
    status = reason.get("status_code")
    if status is None and not message.startswith(_FAILED):
        return None
    own = any(word in message for word in _REQUESTS_OWN)
    return APIError(int(status) if status else 400 if own else 500, message,
                    param=grammar_param if "GrammarError" in message else None)


def _grammar_param(req: Req, names: ParamNames) -> str | None:
    """The request field of a request's grammar (response_format, tool_choice, ...), None without one."""
    spec = grammar_of(req.params)
    return names(spec[0]) if spec is not None else None


def _usage(outs: list[dict[str, Any]], n: int = 1, cache_report: bool = False) -> dict[str, Any]:
    """Usage of outputs, n per prompt in a row: every completion token, each prompt's tokens once;
    prompt_tokens_details.cached_tokens only with --enable-cache-report (null otherwise, as SGLang)."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached} if cache_report else None}


class _Tokens:
    """Token id -> display string for logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def __call__(self, tid: int) -> str:
        return self.tok.decode([tid]) if self.tok is not None else str(tid)


def _completion_logprobs(meta: dict[str, Any], start: int, names: _Tokens, offset: int,
                         echo: bool = False) -> dict[str, Any]:
    """OpenAI's completion logprobs of the output tokens from `start`; with echo, the prompt's first
    (first logprob null, as OpenAI gives it), as lm-evaluation-harness's loglikelihood reads them."""
    toks = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    if echo:
        toks = meta.get("input_token_logprobs", []) + toks
        tops = meta.get("input_top_logprobs", [[] for _ in meta.get("input_token_logprobs", [])]) + tops
        if not meta.get("output_top_logprobs") and not meta.get("input_top_logprobs"):
            tops = []
    strs = [names(t) for _, t, _ in toks]
    offsets, pos = [], offset
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strs, "token_logprobs": [lp for lp, _, _ in toks],
            "top_logprobs": [None if top is None else {names(t): lp for lp, t, _ in top} for top in tops]
            if tops else None,
            "text_offset": offsets}


def _chat_logprobs(meta: dict[str, Any], start: int, names: _Tokens) -> dict[str, Any]:
    toks = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [[] for _ in toks]

    def entry(lp: float, tid: int) -> dict[str, Any]:
        s = names(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [dict(entry(lp, t), top_logprobs=[entry(v, u) for v, u, _ in top])
                        for (lp, t, _), top in zip(toks, tops)]}


# Chats of more messages than this are made template messages in a thread: ~5 us a message, 200,000 of them
# (a 6.5 MiB body) held the event loop for about a second.
OFF_LOOP_MESSAGES = 1000


def _template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages = []
    for m in body.messages:
        msg = m.model_dump(exclude_none=True)
        # content parts (text only: others are refused) joined; a null content (OpenAI's assistant message that
        # carries tool_calls) is "" as SGLang renders it: templates index message['content'], which was missing
        # (a 400 "has no attribute 'content'" for a well-formed conversation)
        msg["content"] = m.text if m.content is not None else ""
        messages.append(template_message(msg))
    return messages


async def _chat_prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if len(body.messages) > OFF_LOOP_MESSAGES:
        messages = await asyncio.to_thread(_template_messages, body)
    else:
        messages = _template_messages(body)
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    tools = template_tools(body)
    if tools is not None:  # the template's `tools` variable (tool_protocol.py keeps clients from setting it)
        kwargs["tools"] = tools
    # rendered sandboxed and time-limited in a worker (state.chat_prompt_ids), never on the event loop
    return await state.chat_prompt_ids(messages, body.continue_final_message, kwargs or None)


@dataclass(frozen=True)
class ChatJob:
    """A chat request made ready to submit: its template rendered, tools and reasoning planned, grammar compiled."""

    req: Req
    plan: ChatPlan  # how the answer is constrained and parsed
    tail: str  # the prompt's last tokens as text (whether it opens a thinking part)
    grammar: str | None  # the request field of its grammar, named by an error about it


async def build_chat(state: ServerState, body: ChatCompletionRequest, lora: str | None, renames: dict[str, str],
                     prompt_field: str = "messages") -> ChatJob:
    """The request of a chat body (/v1/chat/completions, and /v1/responses translated into one). renames: the
    engine's field -> the route's name of it, for an error's `param`; prompt_field: the route's field of the
    conversation (APIError 400 naming it when the template refuses it or it is too long)."""
    try:
        ids = await _chat_prompt_ids(state, body)
    except APIError as e:
        if e.param == "messages":  # the route's own name for the conversation
            e.param = prompt_field
        raise
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # the model's recommended values under the request's (--sampling-defaults model, SGLang's default)
    params = state.sampling.for_chat(_sampling(body, explicit if explicit is not None else state.core.context_len))
    plan = await plan_chat(state.server_config, body, params)  # tools and reasoning: may add a grammar
    tail = prompt_tail(state.core.tokenizer, ids) if plan.reasoning_format is not None else ""
    top = body.top_logprobs or 0
    renames = dict(renames)
    if plan.forced:  # the grammar is tool_choice's (required or a named function)
        renames["ebnf"] = "tool_choice"
    names = ParamNames(prompt_field, renames=renames)
    req = await state.build_req(input_ids=ids, params=params, rid=body.rid, return_logprob=body.logprobs,
                                top_logprobs_num=top if body.logprobs else 0, check_max_tokens=explicit is not None,
                                lora_path=lora, names=names)
    return ChatJob(req, plan, tail, _grammar_param(req, names))


def answer_deltas(parser: ChatOutput, delta: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """A new piece of a chat answer as OpenAI deltas, reasoning and tool calls split out by the parser (its held
    back pieces flushed when the answer ended: reason set), and the finish reason the parser makes of the
    engine's ("tool_calls" after calls)."""
    if not parser.active:
        return ([{"content": delta}] if delta else []), reason
    deltas = parser.feed(delta) + (parser.finish() if reason is not None else [])
    return deltas, parser.finish_reason(reason)


def register_routes(app: FastAPI, state: ServerState) -> None:
    """Add the OpenAI routes to app."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        core, now = state.core, int(time.time())
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": now,
                                             "owned_by": "hybridmoe", "root": state.args.model_path,
                                             "max_model_len": core.context_len}, *adapter_cards(state, now)]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        from_model = state.check_model(body.model)
        if body.logprobs is not None:
            check_top_logprobs(body.logprobs, "logprobs", max_top_logprobs_num(state))
        prompts: list[Any]
        p = body.prompt
        batch = not (isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)))
        prompts = list(p) if batch else [p]  # type: ignore[arg-type]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        adapters = request_adapters(from_model, body, len(prompts) if batch else None)
        if body.stream and len(prompts) > 1:
            raise APIError(400, "stream=true takes one prompt", param="prompt")
        state.check_sequences([body.n] * len(prompts))
        max_tokens = body.max_tokens if body.max_tokens is not None else state.core.context_len
        params = _sampling(body, max_tokens)
        k = body.logprobs
        renames = dict(_OPENAI_RENAMES, max_new_tokens="max_tokens", top_logprobs_num="logprobs",
                       logprob_start_len="echo", **grammar_fields(body))
        # one build for the batch: its texts tokenized in a few jobs, not one a prompt (ServerState.build_reqs)
        specs = [ReqSpec(prompt=x if isinstance(x, str) else None, input_ids=None if isinstance(x, str) else x,
                         params=dict(params), rid=body.rid if len(prompts) == 1 else None,
                         return_logprob=k is not None, top_logprobs_num=k or 0,
                         logprob_start_len=0 if body.echo and k is not None else -1,  # echo: prompt logprobs
                         check_max_tokens=body.max_tokens is not None, lora_path=adapters[i][0],
                         names=ParamNames(f"prompt.{i}" if batch else "prompt",
                                          renames=dict(renames, lora_path=adapters[i][1])))
                 for i, x in enumerate(prompts)]
        reqs = await state.build_reqs(specs, "prompt")
        names = _Tokens(state.core.tokenizer)
        n = body.n or 1
        echoed = await _echo_texts(state, reqs) if body.echo else [""] * len(reqs)
        echo = [e for e in echoed for _ in range(n)]
        grammar = _grammar_param(reqs[0], specs[0].names)
        streams = state.submit(reqs)  # n per prompt, in a row
        created = int(time.time())
        cid = f"cmpl-{reqs[0].rid}"
        base = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name}
        if body.stream:
            events = _completion_events(streams, reqs[0], base, echo[0], names, body, grammar,
                                        cache_report=state.args.enable_cache_report)
            return StreamingResponse(guarded_all(streams, state.engine, events), media_type="text/event-stream")
        outs = await results(request, state.engine, streams)
        _raise_failed(outs, grammar)
        choices = []
        for i, out in enumerate(outs):
            reason, matched = _finish(out)
            lp = _completion_logprobs(out["meta_info"], 0, names, 0, echo=body.echo) if k is not None else None
            choices.append({"index": i, "text": echo[i] + out["text"], "logprobs": lp, "finish_reason": reason,
                            "matched_stop": matched})
        return dict(base, choices=choices, usage=_usage(outs, n, state.args.enable_cache_report))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        [(lora, lora_param)] = request_adapters(state.check_model(body.model), body)
        if body.top_logprobs is not None:
            check_top_logprobs(body.top_logprobs, "top_logprobs", max_top_logprobs_num(state))
            if body.top_logprobs > 0 and not body.logprobs:  # OpenAI's rule (it was silently ignored)
                raise APIError(400, "top_logprobs needs logprobs: true (top_logprobs is the number of most likely "
                                    "tokens returned with each token's logprob)", param="top_logprobs")
        renames = dict(_OPENAI_RENAMES, top_logprobs_num="top_logprobs", lora_path=lora_param,
                       **grammar_fields(body),
                       max_new_tokens="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        job = await build_chat(state, body, lora, renames)
        req, plan, tail, grammar = job.req, job.plan, job.tail, job.grammar
        names = _Tokens(state.core.tokenizer)
        streams = state.submit([req])  # n > 1: n streams
        base = {"id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name}
        if body.stream:
            parsers = [plan.output(tail, eager=True) for _ in streams]  # one a sequence (n > 1)
            events = _chat_events(streams, req, dict(base, object="chat.completion.chunk"), names, body, parsers,
                                  grammar, cache_report=state.args.enable_cache_report)
            return StreamingResponse(guarded_all(streams, state.engine, events), media_type="text/event-stream")
        outs = await results(request, state.engine, streams)
        _raise_failed(outs, grammar)
        choices = []
        for i, out in enumerate(outs):
            reason, matched = _finish(out)
            parser = plan.output(tail, eager=False)
            message = parser.message(out["text"]) if parser.active else {
                "role": "assistant", "content": out["text"], "reasoning_content": None, "tool_calls": None}
            choices.append({"index": i, "message": message,
                            "logprobs": _chat_logprobs(out["meta_info"], 0, names) if body.logprobs else None,
                            "finish_reason": parser.finish_reason(reason), "matched_stop": matched})
        return dict(base, choices=choices, usage=_usage(outs, len(outs), state.args.enable_cache_report))


def _raise_failed(outs: list[dict[str, Any]], grammar_param: str | None) -> None:
    """A non-streamed response with a sequence that failed is that failure's error (as a streamed one ends with it)."""
    for out in outs:
        error = _abort_error(out, grammar_param)
        if error is not None:
            raise error


async def _echo_texts(state: ServerState, reqs: list[Req]) -> list[str]:
    """echo: each prompt's text, decoded off the event loop (a batch in a few jobs)."""
    if state.core.tokenizer is None:
        return [""] * len(reqs)
    seqs = [r.prompt_ids for r in reqs]
    if len(seqs) == 1:
        return [await state.decode(seqs[0], skip_special_tokens=False, field="prompt")]
    return await state.decode_batch(seqs, skip_special_tokens=False, field="prompt")


async def _completion_events(streams: list[RequestStream], req: Req, base: dict[str, Any], echo: str,
                             names: _Tokens, body: CompletionRequest, grammar_param: str | None = None,
                             cache_report: bool = False) -> AsyncIterator[bytes]:
    """The chunks of n streams of one prompt, each chunk with its sequence's index; usage after the last. A
    sequence that fails ends the stream with an error event (as a non-streamed request answers with it)."""
    n, stops = len(streams), req.params.stop_strs
    sent_text, sent_tokens, finals = [""] * n, [0] * n, [None] * n
    if echo:  # the prompt's logprobs (echo) arrive with the first output, in its chunk
        for i in range(n):
            yield sse(dict(base, choices=[{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]))
    try:
        async for i, out in merged(streams):
            failed = _abort_error(out, grammar_param)
            if failed is not None:
                yield sse(error_body(failed.status, failed.message, failed.param))
                break
            text = visible_text(out, stops)
            reason, matched = _finish(out)
            lp = None
            if body.logprobs is not None:
                first = bool(echo) and sent_tokens[i] == 0 and not sent_text[i]
                lp = _completion_logprobs(out["meta_info"], sent_tokens[i], names,
                                          0 if first else len(echo) + len(sent_text[i]), echo=first)
            sent_tokens[i] = out["meta_info"]["completion_tokens"]
            delta, sent_text[i] = text[len(sent_text[i]):], text
            if delta or reason is not None or lp is not None:
                choice = {"index": i, "text": delta, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
                yield sse(dict(base, choices=[choice]))
            if reason is not None:
                finals[i] = out
        if body.stream_options and body.stream_options.include_usage and all(f is not None for f in finals):
            yield sse(dict(base, choices=[], usage=_usage(finals, n, cache_report)))
    except EngineFailed as e:
        yield sse(error_body(500, str(e)))
    yield DONE


async def _chat_events(streams: list[RequestStream], req: Req, base: dict[str, Any], names: _Tokens,
                       body: ChatCompletionRequest, parsers: list[ChatOutput], grammar_param: str | None = None,
                       cache_report: bool = False) -> AsyncIterator[bytes]:
    """The chunks of n streams, each chunk with its sequence's index (reasoning and tool calls split out
    by each sequence's parser); usage after the last. A sequence that fails ends the stream with an error
    event (as a non-streamed request answers with it)."""
    n, stops = len(streams), req.params.stop_strs
    sent_text, sent_tokens, finals = [""] * n, [0] * n, [None] * n
    for i in range(n):
        yield sse(dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}]))
    try:
        async for i, out in merged(streams):
            failed = _abort_error(out, grammar_param)
            if failed is not None:
                yield sse(error_body(failed.status, failed.message, failed.param))
                break
            text = visible_text(out, stops)
            reason, matched = _finish(out)
            lp = _chat_logprobs(out["meta_info"], sent_tokens[i], names) if body.logprobs else None
            sent_tokens[i] = out["meta_info"]["completion_tokens"]
            delta, sent_text[i] = text[len(sent_text[i]):], text
            deltas, reason = answer_deltas(parsers[i], delta, reason)
            if reason is not None or lp is not None:
                deltas = deltas or [{}]
            for j, d in enumerate(deltas):  # logprobs on the first, finish_reason on the last
                last = j == len(deltas) - 1
                choice = {"index": i, "delta": d, "logprobs": lp if j == 0 else None,
                          "finish_reason": reason if last else None, "matched_stop": matched if last else None}
                yield sse(dict(base, choices=[choice]))
            if reason is not None:
                finals[i] = out
        if body.stream_options and body.stream_options.include_usage and all(f is not None for f in finals):
            yield sse(dict(base, choices=[], usage=_usage(finals, n, cache_report)))
    except EngineFailed as e:
        yield sse(error_body(500, str(e)))
    yield DONE
