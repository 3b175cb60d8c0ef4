"""Connection and request limits below the routes.

`LimitedH11Protocol` (uvicorn's h11 protocol, per connection): a connection beyond
--max-connections gets 503; one that does not send a request's headers within --header-timeout
gets 408 and is closed; one whose client reads nothing of the response for --write-timeout is cut
off (the route then sees a disconnect, so its request is aborted and its KV pages freed).

`RequestLimitsMiddleware` (ASGI, per request): a body larger than --max-request-body-size gets 413
(at once when Content-Length says so), one not received within --body-timeout gets 408; both close
the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridmoe.server.errors import error_body
from hybridmoe.server.limits import ServerLimits

log = logging.getLogger(__name__)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _json_error(status: int, message: str, extra: list[tuple[bytes, bytes]] = ()) -> tuple[list, bytes]:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *extra]
    return headers, body


async def _respond(send: Callable, status: int, message: str, extra: list[tuple[bytes, bytes]] = ()) -> None:
    headers, body = _json_error(status, message, extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection limit, a header timeout and a write timeout.

    The limits come from the uvicorn config's `hybridmoe_limits` attribute (set by run.py).
    """

    def __init__(self, config: Any, server_state: Any, app_state: dict, _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits: ServerLimits = getattr(config, "hybridmoe_limits", None) or ServerLimits()
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_cycle: Any = None  # the request cycle current when the header timer was armed
        self._write_timer: asyncio.TimerHandle | None = None

    # ---- connections ----
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("%d open connections (--max-connections %d): answering 503", len(self.connections),
                        self.limits.max_connections)
            self.app = self._too_many_connections
        self._arm_header_timer()

    async def _too_many_connections(self, scope: dict, receive: Callable, send: Callable) -> None:
        await _respond(send, 503, f"too many open connections (--max-connections {self.limits.max_connections}); "
                                  "retry later", [(b"retry-after", b"1")])

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    # ---- header timeout ----
    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_cycle = self.cycle
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._header_cycle:  # a new request's headers arrived
            self._cancel_header_timer()
        if self._waiting_for_headers() and not self.transport.is_closing():
            self._arm_header_timer()  # bytes of the next request: its headers must follow in time

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.cycle is not self._header_cycle or not self._waiting_for_headers():
            return
        log.info("a connection sent no complete request headers within %.1f s (--header-timeout): closing it",
                 self.limits.header_timeout)
        headers, body = _json_error(408, f"the request headers did not arrive within {self.limits.header_timeout} s "
                                         "(--header-timeout)")
        head = b"HTTP/1.1 408 Request Timeout\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
        self.transport.write(head + b"\r\n" + body)
        self.transport.close()

    # ---- write timeout ----
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        path = self.scope.get("path") if self.scope else None
        log.warning("a client read nothing of its response to %s for %.1f s (--write-timeout): closing the "
                    "connection, its request is aborted", path, self.limits.write_timeout)
        self.transport.abort()  # connection_lost follows: the route sees a disconnect


class RequestLimitsMiddleware:
    """Reads each request body under the size limit and the body timeout, then hands it on."""

    def __init__(self, app: Callable, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_request_body_size
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _respond(send, 400, f"bad Content-Length header {length[:40]!r}")
            if declared > limit:
                return await _respond(send, 413, f"the request body has {declared} bytes; the limit is {limit} "
                                                 "(--max-request-body-size)")
        if scope.get("method") not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        coding = dict(scope.get("headers") or []).get(b"content-encoding", b"").strip().lower()
        if coding not in (b"", b"identity"):
            # nothing here decompresses (so no decompression bomb either): the body would fail as "not UTF-8";
            # RFC 9110 15.5.16: 415, with Accept-Encoding naming what is taken
            return await _respond(send, 415, f"Content-Encoding {coding.decode('latin-1')[:40]!r} is not supported; "
                                             "send the body uncompressed", [(b"accept-encoding", b"identity")])
        body = await self._read_body(receive, send)
        if body is None:
            return
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect detection

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Callable, send: Callable) -> bytes | None:
        """The whole body; None when a response was sent instead (413, 408) or the client left."""
        limit, timeout = self.limits.max_request_body_size, self.limits.body_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _respond(send, 408, f"the request body did not arrive within {timeout} s (--body-timeout)")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _respond(send, 413, f"the request body exceeds {limit} bytes (--max-request-body-size)")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
