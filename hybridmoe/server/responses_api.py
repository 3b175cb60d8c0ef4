"""POST /v1/responses: OpenAI's Responses API, the stateless part, served by the chat-completions machinery.

A request is translated into the /v1/chat/completions request that serves it (responses_protocol.chat_request)
and built by the same code (openai_api.build_chat), so the chat template, tool-call and reasoning parsers,
structured output, LoRA adapters (`model: "<served>:<adapter>"`) and limits are the chat route's. The answer's
chat deltas (reasoning, text, tool calls) become output items (OutputItems): the same items whether streamed or
not. Nothing is stored: `store` is accepted either way, `previous_response_id` refused.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from hybridmoe.server.async_engine import EngineFailed, RequestStream
from hybridmoe.server.errors import APIError
from hybridmoe.server.openai_api import (
    _OPENAI_RENAMES,
    OFF_LOOP_MESSAGES,
    ChatJob,
    _abort_error,
    _finish,
    _raise_failed,
    _usage,
    answer_deltas,
    build_chat,
)
from hybridmoe.server.protocol import ChatCompletionRequest
from hybridmoe.server.responses_protocol import FunctionChoice, ResponsesRequest, chat_request
from hybridmoe.server.state import ServerState
from hybridmoe.server.streaming import guarded, results, sse, visible_text
from hybridmoe.server.structured import grammar_fields

Event = dict[str, Any]

# the event that streams a piece of each kind of text item, and the one that ends it
_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


class OutputItems:
    """The output items of one answer, built from its chat deltas (ChatOutput's, in order): reasoning, message
    text, function calls. An item opens with its first piece and closes when an item of another kind opens or
    the answer ends. feed() and finish() return the stream events of each step (without sequence numbers);
    `output` is the response's output array, the same whether the answer was streamed or not."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.output: list[dict[str, Any]] = []
        self._open: int | None = None  # output index of the item being written
        self._open_key: Any = None  # "message", "reasoning", or ("call", the parser's index of the call)
        self._calls: dict[int, int] = {}  # the parser's index of a call -> its output index
        self._counts = {"message": 0, "reasoning": 0}
        # the open text item's pieces, joined when it closes (+= on its text copied it all at every piece: quadratic
        # in a long streamed answer)
        self._pieces: list[str] = []

    def feed(self, deltas: list[dict[str, Any]]) -> list[Event]:
        """Events of a step's chat deltas ({"reasoning_content"}, {"content"}, {"tool_calls"})."""
        events: list[Event] = []
        for d in deltas:
            if d.get("reasoning_content"):
                events += self._text("reasoning", d["reasoning_content"])
            if d.get("content"):
                events += self._text("message", d["content"])
            for call in d.get("tool_calls", ()):
                events += self._call(call)
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the open item (status incomplete unless the response completed). An answer that made neither
        text nor calls still gets its (empty) message, as a client reads the answer from one."""
        item_status = "completed" if status == "completed" else "incomplete"
        events = self._close(item_status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self._begin_text("message") + self._close(item_status)
        return events

    def so_far(self) -> list[dict[str, Any]]:
        """The output array now, the open text item's pieces so far included (an answer that failed midway)."""
        if self._open is not None and self.output[self._open]["type"] != "function_call":
            self.output[self._open]["content"][0]["text"] = "".join(self._pieces)
        return self.output

    def _item_id(self, prefix: str, kind: str) -> str:
        n = self._counts[kind]
        self._counts[kind] += 1
        return f"{prefix}_{self.rid}" + (f"_{n}" if n else "")

    def _begin_text(self, kind: str) -> list[Event]:
        index = len(self.output)
        if kind == "message":
            item = {"id": self._item_id("msg", kind), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": self._item_id("rs", kind), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self._open, self._open_key = index, kind
        events = [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)},
                  {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "part": dict(part)}]
        item["content"].append(part)
        return events

    def _text(self, kind: str, piece: str) -> list[Event]:
        events = [] if self._open_key == kind else self._close("completed") + self._begin_text(kind)
        assert self._open is not None
        item = self.output[self._open]
        self._pieces.append(piece)
        event = {"type": _DELTA[kind], "item_id": item["id"], "output_index": self._open, "content_index": 0,
                 "delta": piece}
        if kind == "message":
            event["logprobs"] = []
        return [*events, event]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if "id" in call:  # a new call: its name now, its arguments in pieces
            events = self._close("completed")
            index = len(self.output)
            item = {"id": f"fc_{self.rid}_{call['index']}", "type": "function_call", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            self.output.append(item)
            self._calls[call["index"]] = index
            self._open, self._open_key = index, ("call", call["index"])
            events.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        index = self._calls.get(call["index"])
        piece = call["function"].get("arguments", "")
        if index is not None and piece:
            item = self.output[index]
            item["arguments"] += piece
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": piece})
        return events

    def _close(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        index, item = self._open, self.output[self._open]
        self._open = self._open_key = None
        item["status"] = status
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                       "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            part["text"], self._pieces = "".join(self._pieces), []
            done = {"type": _DONE[item["type"]], "item_id": item["id"], "output_index": index, "content_index": 0,
                    "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                             "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return events


def _shell(body: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
    """The response object before any output: its id and the request's settings, echoed as OpenAI does."""
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice
    return {"id": f"resp_{rid}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "usage": None, "error": None, "incomplete_details": None,
            "completed_at": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump() for t in body.tools or []], "tool_choice": choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "metadata": body.metadata or {}, "user": body.user, "prompt_cache_key": body.prompt_cache_key,
            "safety_identifier": body.safety_identifier,
            "store": False, "background": False, "previous_response_id": None, "truncation": "disabled"}


def _status(reason: str | None) -> str:
    """The response status of a finished answer's finish reason (a failure was answered as an error before)."""
    if reason == "length":
        return "incomplete"
    if reason == "abort":  # the server's own abort: an operator's /abort_request, shutdown
        return "cancelled"
    return "completed"


async def _reasoning_tokens(state: ServerState, output: list[dict[str, Any]], completion_tokens: int) -> int:
    """Tokens of the reasoning items' text: the parser splits text, not tokens, so the text is tokenized again (off
    the event loop); at most the answer's own count."""
    text = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
    if not text:
        return 0
    try:
        return min(len(await state.encode(text, "input", add_special_tokens=False)), completion_tokens)
    except APIError:  # (longer than the context once tokenized again)
        return completion_tokens


async def _finished(state: ServerState, shell: dict[str, Any], out: dict[str, Any], items: OutputItems,
                    status: str) -> dict[str, Any]:
    """The response object of a finished answer: output, usage, status and why it is not complete."""
    usage = _usage([out], 1, state.args.enable_cache_report)  # the chat route's numbers
    cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens", 0)  # 0 unless --enable-cache-report
    reasoning = await _reasoning_tokens(state, items.output, usage["completion_tokens"])
    message = out["meta_info"]["finish_reason"].get("message") if status == "cancelled" else None
    return dict(shell, status=status, output=items.output,
                usage={"input_tokens": usage["prompt_tokens"],
                       "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                       "output_tokens": usage["completion_tokens"],
                       "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": usage["total_tokens"]},
                incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
                completed_at=int(time.time()) if status == "completed" else None,
                error={"code": "server_error", "message": message or "cancelled"} if status == "cancelled" else None)


def _event_bytes(event: Event) -> bytes:
    """One server-sent event named by its type, as OpenAI sends them (no [DONE] after the last)."""
    return b"event: " + event["type"].encode() + b"\n" + sse(event)


def _failure(error: APIError, shell: dict[str, Any], items: OutputItems) -> Iterator[Event]:
    """The end of a stream whose request failed after its 200 was sent (as the chat route's error event): an
    `error` event, then response.failed with the output so far."""
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    yield {"type": "error", "code": code, "message": error.message, "param": error.param}
    yield {"type": "response.failed", "response": dict(shell, status="failed", output=items.so_far(),
                                                       error={"code": code, "message": error.message})}


async def _events(state: ServerState, stream: RequestStream, job: ChatJob, shell: dict[str, Any]) -> AsyncIterator[bytes]:
    """The stream of a response: created, in_progress, each item's events, then completed (or incomplete, or
    failed); every event with its sequence number. Stop strings are held back as on the chat route."""
    seq = itertools.count()

    def emit(event: Event) -> bytes:
        return _event_bytes(dict(event, sequence_number=next(seq)))

    yield emit({"type": "response.created", "response": shell})
    yield emit({"type": "response.in_progress", "response": shell})
    items, parser = OutputItems(job.req.rid), job.plan.output(job.tail, eager=True)
    stops, sent = job.req.params.stop_strs, ""
    final: dict[str, Any] | None = None
    reason: str | None = None
    try:
        async for out in stream:
            failed = _abort_error(out, job.grammar)
            if failed is not None:
                for event in _failure(failed, shell, items):
                    yield emit(event)
                return
            text = visible_text(out, stops)
            deltas, reason = answer_deltas(parser, text[len(sent):], _finish(out)[0])
            sent = text
            for event in items.feed(deltas):
                yield emit(event)
            if reason is not None:
                final = out
    except EngineFailed as e:
        for event in _failure(APIError(500, str(e)), shell, items):
            yield emit(event)
        return
    if final is None:  # the stream ended without a finished output (not seen; the engine always ends one)
        for event in _failure(APIError(500, "the request ended without a result"), shell, items):
            yield emit(event)
        return
    status = _status(reason)
    for event in items.finish(status):
        yield emit(event)
    response = await _finished(state, shell, final, items, status)
    terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
    yield emit({"type": terminal, "response": response})


def _renames(chat: ChatCompletionRequest) -> dict[str, str]:
    """The engine's fields as this route names them in an error's `param`."""
    renames = dict(_OPENAI_RENAMES, max_new_tokens="max_output_tokens", top_logprobs_num="top_logprobs")
    renames.update({name: "text.format" for name in grammar_fields(chat)})  # the chat route's response_format
    return renames


async def _chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request of a Responses request; a long input is translated in a thread (as the chat route makes
    its template messages), not on the event loop."""
    if isinstance(body.input, list) and len(body.input) > OFF_LOOP_MESSAGES:
        return await asyncio.to_thread(chat_request, body)
    return chat_request(body)


def register_routes(app: FastAPI, state: ServerState) -> None:
    """Add POST /v1/responses to app."""

    @app.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API (stateless): one answer, streamed as OpenAI's events or not."""
        lora = state.check_model(body.model)
        chat = await _chat_body(body)
        job = await build_chat(state, chat, lora, _renames(chat), prompt_field="input")
        stream = state.submit([job.req])[0]
        shell = _shell(body, job.req.rid, state.model_name)
        if body.stream:
            events = _events(state, stream, job, shell)
            return StreamingResponse(guarded(stream, state.engine, events), media_type="text/event-stream")
        outs = await results(request, state.engine, [stream])
        _raise_failed(outs, job.grammar)
        out = outs[0]
        items = OutputItems(job.req.rid)
        deltas, reason = answer_deltas(job.plan.output(job.tail, eager=False), out["text"], _finish(out)[0])
        status = _status(reason)
        items.feed(deltas)
        items.finish(status)
        return await _finished(state, shell, out, items, status)
