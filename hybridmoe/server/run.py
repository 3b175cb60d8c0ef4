"""Run the app under uvicorn with a graceful shutdown.

On SIGTERM/SIGINT the server stops accepting connections and new requests get 503; running
requests may finish for `graceful_shutdown_timeout` seconds, then the rest are aborted (they end
with an abort finish_reason, so every client gets a complete response); then the engine stops.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn

from hybridmoe.config import EngineArgs
from hybridmoe.server.app import create_app
from hybridmoe.server.state import ServerState

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace = grace
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        engine = self.state.engine
        if not engine.draining:
            engine.draining = True
            n = len(engine.streams)
            log.info("shutting down: %d request(s) in flight get %.0f s to finish", n, self.grace)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._schedule_abort)
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal after its shutdown (the process then dies of it); a
        # graceful stop is a normal exit here: status 0.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    def _schedule_abort(self) -> None:
        assert self.loop is not None
        self.loop.call_later(self.grace, self.state.engine.abort_all, "the server is shutting down")


def run_server(args: EngineArgs, graceful_shutdown_timeout: float = 30.0) -> int:
    """Serve until a signal stops the server; 0, or 1 if the model failed to load."""
    app = create_app(args)
    state: ServerState = app.state.hybridmoe
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=graceful_shutdown_timeout + 10, lifespan="on")
    sock = _bind(args.host, args.port)  # before the model loads: a busy port fails at once
    if sock is None:
        return 1
    server = _Server(config, state, graceful_shutdown_timeout)
    state.server = server
    log.info("serving %s at http://%s:%d", state.model_name, args.host, sock.getsockname()[1])
    server.run(sockets=[sock])
    return state.exit_code


def _bind(host: str, port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", host, port, e)
        sock.close()
        return None
    sock.set_inheritable(True)
    return sock
