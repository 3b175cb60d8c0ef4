"""The engine <-> asyncio bridge.

One dedicated thread owns the model: it builds the Engine, then runs `step()` while there is work
and sleeps on an event otherwise. The event loop never calls into the model; it submits requests
(`Engine.submit`/`abort` are thread-safe) and receives each step's outputs, snapshotted on the
engine thread, through `loop.call_soon_threadsafe` into one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.request import Req
from hybridmoe.server.metrics import ServerMetrics
from hybridmoe.server.request_log import log_finished, log_received
from hybridmoe.server.watchdog import StepWatchdog

log = logging.getLogger(__name__)

class Unavailable(RuntimeError):
    """The server cannot take the request now (starting, overloaded, shutting down): HTTP 503."""


class EngineFailed(RuntimeError):
    """The engine raised while running a request: HTTP 500."""


class RequestStream:
    """Outputs of one request, as SGLang-style dicts with cumulative text and output_ids."""

    def __init__(self, rid: str, stream_interval: int = 1) -> None:
        self.rid = rid
        self.stream_interval = stream_interval  # --stream-interval: new tokens between two updates
        self._sent_tokens = 0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.started = False  # got its first output
        # result() is waited on: the engine thread builds this request's first output (it has started) and its
        # last only, not one a step (0.6 ms a step for 64 requests of 4000 tokens, and a wake-up each)
        self.quiet = False
        self.last: dict | None = None

    async def __aiter__(self) -> AsyncIterator[dict]:
        while not self.finished:
            item = await self.queue.get()
            while not self.queue.empty() and not isinstance(item, EngineFailed):
                item = self.queue.get_nowait()  # outputs are cumulative: keep only the newest
            if isinstance(item, EngineFailed):
                self.finished = True
                raise item
            self.last = item
            if item["meta_info"]["finish_reason"] is not None:
                self.finished = True
            elif not self._due(item):
                continue
            yield item

    def _due(self, item: dict) -> bool:
        """An unfinished output is sent for the first token, then every stream_interval new tokens
        (outputs are cumulative, so one skipped is contained in the next)."""
        n = len(item.get("output_ids") or ())
        if self._sent_tokens and n - self._sent_tokens < self.stream_interval:
            return False
        self._sent_tokens = max(n, 1)
        return True

    async def result(self) -> dict:
        """Wait for the end; the final output."""
        self.quiet = True
        async for _ in self:
            pass
        assert self.last is not None
        return self.last


class AsyncEngine:
    """Runs an Engine on its own thread and serves its outputs to asyncio tasks."""

    def __init__(self, args: EngineArgs, metrics: ServerMetrics | None = None,
                 engine_factory: Callable[[EngineArgs], Engine] | None = None,
                 max_queued_requests: int | None = None) -> None:
        self.args = args
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self._factory = engine_factory or (lambda a: Engine(a, progress=True))  # the load progress bar
        self.engine: Engine | None = None
        self.ready = False
        self.load_error: BaseException | None = None
        self.draining = False
        self.streams: dict[str, RequestStream] = {}
        self.stats: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stop = False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready_event = threading.Event()
        self.watchdog = StepWatchdog(args.watchdog_timeout)  # --watchdog-timeout, over each engine step

    # ---- lifecycle ----
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; it loads the model, then serves. Returns at once."""
        self._loop = loop
        self._thread = threading.Thread(target=self._main, name="hybridmoe-engine", daemon=True)
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded or failed to load (True when it is ready)."""
        self._ready_event.wait(timeout)
        return self.ready

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (after the requests in flight have been aborted or finished)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.shutdown()  # e.g. writes --record-expert-distribution

    # ---- requests (event-loop thread) ----
    @property
    def num_queued(self) -> int:
        """Requests accepted that have not produced a token yet."""
        return sum(1 for s in self.streams.values() if not s.started)

    def check_available(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down")
        if not self.ready:
            raise Unavailable("the server is starting; retry when GET /health answers 200"
                              if self.load_error is None else f"the model failed to load: {self.load_error}")

    def submit(self, req: Req) -> RequestStream:
        """Queue a request made by `engine.make_request`; raises Unavailable past the queue bound."""
        self.check_available()
        limit = self.max_queued_requests
        if limit is not None and self.num_queued >= limit:
            raise Unavailable(f"too many queued requests (--max-queued-requests {limit}); retry later")
        rids = [req.rid] + [f.rid for f in req.forks]  # n > 1: a stream per sequence
        for rid in rids:
            if rid in self.streams:
                raise ValueError(f"a request with rid {rid!r} is already running")
        stream = RequestStream(req.rid, self.args.stream_interval)
        self.streams[req.rid] = stream
        for rid in rids[1:]:
            self.streams[rid] = RequestStream(rid, self.args.stream_interval)
        if self.args.log_requests:
            log_received(req, self.args.log_requests_level)
        assert self.engine is not None
        self.engine.submit(req)
        self._wake.set()
        return stream

    def stream_of(self, rid: str) -> RequestStream:
        """The stream of a request submitted (a fork's, for n > 1)."""
        return self.streams[rid]

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        """Abort a request (its pages are freed at the engine's next step)."""
        if self.engine is not None and rid in self.streams:
            self.engine.abort(rid, message)
            self._wake.set()

    def abort_all(self, message: str) -> None:
        for rid in list(self.streams):
            self.abort(rid, message)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between two steps; its result."""
        self.check_available()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def _fail(self, rids: list[str], message: str) -> None:
        for rid in rids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(EngineFailed(message))

    def _deliver(self, outs: list[tuple[str, dict]]) -> None:
        for rid, out in outs:
            stream = self.streams.get(rid)
            if stream is None:
                continue
            stream.started = True
            stream.queue.put_nowait(out)
            if out["meta_info"]["finish_reason"] is not None:
                self.streams.pop(rid, None)
                if self.args.log_requests:
                    log_finished(out, self.args.log_requests_level)

    # ---- the engine thread ----
    def _main(self) -> None:
        try:
            self.engine = self._factory(self.args)
        except BaseException as e:  # reported by the server, which exits
            self.load_error = e
            log.error("failed to load the model: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))
            self._ready_event.set()
            return
        self.ready = True
        self._update_stats([])
        self._ready_event.set()
        from hybridmoe.startup import log_summary

        try:
            log_summary(self.engine)  # model, KV cache, where the experts live
        except Exception as e:  # noqa: BLE001  (a summary bug must not stop the server)
            log.warning("no startup summary: %s: %s", type(e).__name__, e)
        self.watchdog.start()
        log.info("the engine is ready (context length %d, %d KV pages of %d tokens)",
                 self.engine.context_len, self.stats["kv_total_pages"], self.stats["page_size"])
        while not self._stop:
            self._run_calls()
            if not self.engine.has_work():
                if not self._wake.wait(timeout=0.5):
                    self._update_stats([])  # idle: let the throughput gauge decay
                self._wake.clear()
                continue
            self._step()
        self._run_calls()
        self.watchdog.stop()

    def _step(self) -> None:
        engine = self.engine
        assert engine is not None and self._loop is not None
        try:
            self.watchdog.begin()
            updated = engine.step()
        except Exception as e:  # a bug outside the forward (which Engine.step isolates): start afresh
            log.exception("engine step failed; failing the requests in flight")
            rids = list(engine.reqs)
            for rid in rids:
                engine.abort(rid, f"engine failure: {e}")
            self._post(self._fail, rids, f"engine failure: {e}")
            time.sleep(0.1)  # a persistent failure must not spin
            return
        finally:
            self.watchdog.end()
        wanted = [r for r in updated if self._wants_output(r)]
        if wanted:
            self._post(self._deliver, engine.outputs(wanted))
        self._update_stats(updated)

    def _wants_output(self, req: Req) -> bool:
        """Whether a request updated by a step needs its output built (engine thread): all but a quiet stream's
        (RequestStream.quiet) between its first output and its last. A stream read on the other thread: at
        worst an output more."""
        stream = self.streams.get(req.rid)
        return stream is None or not stream.quiet or not stream.started or req.finish_reason is not None

    def _post(self, fn: Callable, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _update_stats(self, updated: list[Req]) -> None:
        engine = self.engine
        assert engine is not None
        now = time.time()
        if self.metrics is not None:
            self.metrics.on_step(updated, now)
        stats = engine.stats()
        stats["gen_throughput"] = self.metrics.gen_throughput if self.metrics is not None else 0.0
        self.stats = stats
        if self.metrics is not None:
            self.metrics.set_gauges(stats)
            q = engine.scheduler.queue_times
            if q:
                times = list(q)
                q.clear()
                self.metrics.observe_queue_times(times)
