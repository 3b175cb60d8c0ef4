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

from hybridmoe.config import ConfigError, EngineArgs, ServerConfig
from hybridmoe.log import uvicorn_log_config
from hybridmoe.server.app import create_app
from hybridmoe.server.connections import LimitedH11Protocol
from hybridmoe.server.limits import ServerLimits
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


def build_server(app: Any, args: EngineArgs, limits: ServerLimits, graceful_shutdown_timeout: float = 30.0,
                 port: int | None = None, server: ServerConfig | None = None) -> _Server:
    """The uvicorn server for an app made by create_app, with the connection limits of `limits`,
    listening where `server` says (`port` overrides its port)."""
    server = server or ServerConfig()
    config = uvicorn.Config(app, host=server.host, port=server.port if port is None else port, log_level=args.log_level,
                            log_config=uvicorn_log_config(args.log_level),
                            access_log=False, timeout_graceful_shutdown=graceful_shutdown_timeout + 10, lifespan="on",
                            http=LimitedH11Protocol, timeout_keep_alive=limits.timeout_keep_alive)
    config.hybridmoe_limits = limits  # type: ignore[attr-defined]  # read by LimitedH11Protocol
    server = _Server(config, app.state.hybridmoe, graceful_shutdown_timeout)
    app.state.hybridmoe.server = server
    return server


def run_server(args: EngineArgs, server_config: ServerConfig | None = None, graceful_shutdown_timeout: float = 30.0,
               limits: ServerLimits | None = None) -> int:
    """Serve until a signal stops the server; 0, or 1 if the model failed to load. ConfigError (nothing started)
    when the address cannot be listened on."""
    limits = limits or ServerLimits()
    cfg = server_config or ServerConfig()
    sock = _bind(cfg.host, cfg.port)  # before anything else: a busy port or a bad host fails at once
    try:
        app = create_app(args, limits=limits, server=cfg, freeze_gc=True)
    except BaseException:
        sock.close()
        raise
    state: ServerState = app.state.hybridmoe
    server = build_server(app, args, limits, graceful_shutdown_timeout, server=cfg)
    log.info("serving %s at http://%s:%d", state.model_name, cfg.host, sock.getsockname()[1])
    server.run(sockets=[sock])
    return state.exit_code


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket; ConfigError naming --host and --port when it cannot be bound (a port in use, a host
    that does not resolve or is not this machine's), reported as the other flag errors are: one
    `hybridmoe serve: error:` line, exit code 2 (it was a log line of its own format, split by a newline in --host)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, UnicodeError, TypeError) as e:  # TypeError "encoding of hostname failed": a non-ASCII
        # label the IDNA codec refuses (e.g. 64 accented letters)
        sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"--host {host} --port {port}: cannot listen there: {reason}") from None
    sock.set_inheritable(True)
    return sock
