"""Helpers shared by the native and OpenAI routes: SSE framing, stop-string hold-back, and running a
request to its end while watching for the client going away (its KV pages are freed at once)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from hybridmoe.server.async_engine import AsyncEngine, RequestStream
from hybridmoe.server.errors import APIError
from hybridmoe.server.parsers.text import partial_tail

DONE = b"data: [DONE]\n\n"
# Characters json.dumps(ensure_ascii=False) leaves raw that many line splitters (Python's str.splitlines,
# so any client reading the stream with it) take for line ends, cutting an event in two: escaped,
# the JSON holds the same text.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event: its JSON on one line for every line splitter (see _LINE_BREAKS)."""
    return b"data: " + json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS).encode() + b"\n\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False).translate(_LINE_BREAKS)


class CumulativeEvents:
    """The SSE events of one streamed /generate request, byte for byte what sse() makes of each output.

    SGLang's stream repeats every logprob entry so far in each event (its cumulative format): json.dumps of the
    whole output took 73 ms an event at 8000 tokens with 5 top logprobs (2-core Zen 4), on the event loop, so
    quadratic in the tokens and stalling every other client. Here each entry of a meta_info logprob list is
    encoded once; an event joins the text kept. The lists hold the engine's formatted entries
    (engine/formatted.py), the same objects from one output to the next, new ones appended: a list whose first
    or last entry kept is not the same object as before (or that got shorter) is encoded anew."""

    def __init__(self) -> None:
        # key -> (entries encoded, the first and last of them, their encodings joined by ", ")
        self._kept: dict[str, tuple[int, Any, Any, str]] = {}

    def event(self, data: dict[str, Any]) -> bytes:
        """One event of `data` (the output of this request, possibly with `text` and `index` replaced)."""
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            return sse(data)
        fields = [f"{_dumps(k)}: {self._list(k, v) if k.endswith('_logprobs') and isinstance(v, list) else _dumps(v)}"
                  for k, v in meta.items()]
        meta_json = "{" + ", ".join(fields) + "}"
        body = ", ".join(f"{_dumps(k)}: {meta_json if k == 'meta_info' else _dumps(v)}" for k, v in data.items())
        return b"data: {" + body.encode() + b"}\n\n"

    def _list(self, key: str, entries: list) -> str:
        kept = self._kept.get(key)
        if kept is None or kept[0] > len(entries) or (
                kept[0] and (entries[0] is not kept[1] or entries[kept[0] - 1] is not kept[2])):
            kept = (0, None, None, "")
        done, _, _, joined = kept
        if done < len(entries):
            new = ", ".join(_dumps(e) for e in entries[done:])
            joined = f"{joined}, {new}" if done else new
            kept = (len(entries), entries[0], entries[-1], joined)
            self._kept[key] = kept
        return f"[{joined}]"


def holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could be the start of a stop string.

    A streamed request withholds that tail: if the stop string completes, the engine trims it from
    the text, and a client must never have seen it.
    """
    return partial_tail(text, tuple(stops))


def visible_text(out: dict[str, Any], stops: list[str]) -> str:
    """The text a stream may show now: all of it once finished, else minus the hold-back."""
    text = out["text"]
    if out["meta_info"]["finish_reason"] is not None or not stops:
        return text
    return text[: len(text) - holdback(text, stops)]


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def results(request: Request, engine: AsyncEngine, streams: list[RequestStream]) -> list[dict[str, Any]]:
    """Wait for every stream's final output; if the client disconnects first, abort them all."""
    waiter = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if waiter.done():
            return waiter.result()
        raise APIError(499, "the client disconnected")  # nobody reads it; ends the handler
    finally:
        watcher.cancel()
        if not waiter.done():
            waiter.cancel()
            # a cancelled gather ends with CancelledError set as its exception: taken here, or asyncio logs
            # "exception was never retrieved" with a traceback when the future is collected (seen for a batch
            # whose client gave up)
            waiter.add_done_callback(_retrieve)
        for s in streams:
            if not s.finished:
                engine.abort(s.rid, "the client disconnected")


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def guarded(stream: RequestStream, engine: AsyncEngine, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Wrap a streaming body so that a disconnect (the body is cancelled) aborts the request."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        if not stream.finished:
            engine.abort(stream.rid, "the client disconnected")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(index, output) of several streams (n > 1) as each comes; ends when all have ended. An
    EngineFailed of any stream is raised here."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except Exception as e:  # noqa: BLE001  (handed to the reader)
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def guarded_all(streams: list[RequestStream], engine: AsyncEngine,
                      body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """guarded() for the streams of one response (n > 1): a disconnect aborts every one unfinished."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        for s in streams:
            if not s.finished:
                engine.abort(s.rid, "the client disconnected")
