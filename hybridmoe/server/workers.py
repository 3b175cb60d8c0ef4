"""Tokenization, detokenization and chat templates off the event loop, each within a time limit.

Small inputs run on a few threads (a fast tokenizer releases the GIL; an input of a few KB takes
milliseconds, so there is nothing to bound). Large inputs and every client-supplied chat template
go to worker processes: a thread cannot be stopped, a process can, so a job past its limit
(--tokenize-timeout, --chat-template-timeout) kills its worker, which is replaced, and the request
gets a 400 saying which limit it hit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import multiprocessing
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from hybridmoe.server import worker_main
from hybridmoe.server.errors import APIError
from hybridmoe.server.limits import ServerLimits

log = logging.getLogger(__name__)

INLINE_CHARS = 16384  # texts up to this many characters are tokenized on a thread
INLINE_IDS = 8192  # id lists up to this length are decoded on a thread
INLINE_JSON_BYTES = 1 << 20  # larger request bodies are parsed in a worker (json.loads holds the GIL)
WORKER_START_S = 120.0  # a worker that does not load its tokenizer in this time is given up
QUEUE_WAIT_S = 60.0  # a job waiting longer for a free worker gets 503
# A batch (/tokenize, /detokenize, a /generate or /v1/completions text batch) goes in a few jobs of consecutive
# inputs, not one job per input: each job costs the event loop ~0.1-0.2 ms of its own, so 4096 one-line prompts
# held it (every other request, /health included) for 0.4-1 s. A job holds at most BATCH_ITEMS inputs and, past
# one input, at most BATCH_CHARS characters (BATCH_IDS ids): no more work than one large input, so the per-job
# --tokenize-timeout keeps its meaning. Each input also weighs ITEM_WEIGHT (the tokenizer's Python overhead,
# ~70 us, is that of a few hundred characters): a job whose weight is at most INLINE_CHARS (INLINE_IDS) runs on a
# thread, like a small input; heavier ones go to the worker processes, where the tokenizer's Python does not
# contend with the event loop for the GIL. (Decoding one short list costs ~5 us: ITEM_WEIGHT_IDS.)
BATCH_ITEMS = 1024
BATCH_CHARS = 1 << 20
BATCH_IDS = 1 << 18
ITEM_WEIGHT = 256
ITEM_WEIGHT_IDS = 16


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Worker:
    proc: Any
    conn: Any


class PromptTooLong(Exception):
    """A prompt of n tokens, at or past the limit; index: its place in a batch (None: a single prompt)."""

    def __init__(self, n: int, index: int | None = None) -> None:
        super().__init__(n)
        self.n = n
        self.index = index


class BatchItemError(Exception):
    """One input of a batch failed (its tokenizer raised); index: its place in the batch."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.message = message


def batch_chunks(sizes: list[int], limit: int) -> list[range]:
    """Consecutive inputs grouped into jobs of at most BATCH_ITEMS inputs and `limit` in size (an input larger
    than the limit is a job of its own)."""
    chunks: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= BATCH_ITEMS or total + size > limit):
            chunks.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


class TokenizerPool:
    """Threads for small inputs, killable processes for large ones; started once the engine is up."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.tokenizer: Any = None
        self._blob: bytes | None = None
        self._idle: asyncio.Queue[_Worker] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="hybridmoe-tok")
        self._waiters = concurrent.futures.ThreadPoolExecutor(limits.tokenizer_workers + 1,
                                                              thread_name_prefix="hybridmoe-tokpool")
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process with an engine thread
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads_only = False  # the tokenizer could not be sent to a process

    # ---- lifecycle ----
    @property
    def started(self) -> bool:
        return self._loop is not None

    def start(self, tokenizer: Any) -> None:
        """Use this tokenizer (threads at once; workers load a pickled copy in the background).
        Call on the event loop; a second call does nothing."""
        if self.started:
            return
        self.tokenizer = tokenizer
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        if tokenizer is None:
            return
        threading.Thread(target=self._start_all, name="hybridmoe-tokpool-start", daemon=True).start()

    def _start_all(self) -> None:
        try:
            self._blob = pickle.dumps(self.tokenizer)
        except Exception as e:
            log.warning("the tokenizer cannot be sent to worker processes (%s): large inputs will wait on threads", e)
            self._threads_only = True
            return
        try:
            for _ in range(self.limits.tokenizer_workers):
                self._spawn()
        except Exception as e:  # e.g. the pool closed meanwhile
            if not self._closed:
                log.warning("starting the tokenizer workers failed: %s", e)

    def _spawn(self) -> None:
        """Start one worker and hand it to the pool once it is ready (blocking: runs on a thread)."""
        if self._closed or self._blob is None:
            return
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main.main, args=(child, self._blob), name="hybridmoe-tokenizer",
                                 daemon=True)
        proc.start()
        child.close()
        worker = _Worker(proc, parent)
        with self._lock:
            self._workers.add(worker)
        try:
            ready = parent.poll(WORKER_START_S)
            reply = parent.recv() if ready else ("failed", f"no answer in {WORKER_START_S:.0f} s")
        except (EOFError, OSError) as e:  # it died, or the pool was closed meanwhile
            reply = ("failed", f"{type(e).__name__}: {e}; exit code {proc.exitcode}")
        if reply[0] != "ready":
            if not self._closed:
                log.error("a tokenizer worker failed to start: %s", reply[1])
            self._kill(worker)
            return
        self._post_idle(worker)

    def _post_idle(self, worker: _Worker) -> None:
        assert self._loop is not None and self._idle is not None
        try:
            self._loop.call_soon_threadsafe(self._idle.put_nowait, worker)
        except RuntimeError:  # the loop is closed
            self._kill(worker)

    def _kill(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        if worker.proc.is_alive():
            worker.proc.kill()
        worker.proc.join(5)
        worker.conn.close()

    def close(self) -> None:
        """Stop the workers (server shutdown)."""
        self._closed = True
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            self._kill(w)
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._waiters.shutdown(wait=False, cancel_futures=True)

    # ---- jobs ----
    def _tok(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send and receive token ids")
        return self.tokenizer

    async def encode(self, text: str, *, add_special_tokens: bool = True, max_len: int | None = None,
                     field: str = "text") -> list[int]:
        """Token ids of text; PromptTooLong(n) when it has max_len tokens or more."""
        job = ("encode", text, add_special_tokens, max_len)
        reply = await self._run(job, len(text) <= INLINE_CHARS, self.limits.tokenize_timeout, "tokenizing", field,
                                "--tokenize-timeout")
        return self._ids(reply)

    async def decode(self, ids: list[int], *, skip_special_tokens: bool = True, field: str = "tokens") -> str:
        reply = await self._run(("decode", ids, skip_special_tokens), len(ids) <= INLINE_IDS,
                                self.limits.tokenize_timeout, "detokenizing", field, "--tokenize-timeout")
        return reply[1]

    async def encode_batch(self, texts: list[str], *, add_special_tokens: bool = True, max_len: int | None = None,
                           field: str = "text") -> list[list[int]]:
        """Token ids of each text, in a few jobs (batch_chunks); PromptTooLong(n, index) for the first text with
        max_len tokens or more, BatchItemError(index, message) for the first whose tokenizer raised."""
        sizes = [len(t) for t in texts]
        jobs = [(("encode_batch", texts[r.start:r.stop], add_special_tokens, max_len),
                 sum(sizes[r.start:r.stop]) + ITEM_WEIGHT * len(r) <= INLINE_CHARS, r)
                for r in batch_chunks(sizes, BATCH_CHARS)]
        replies = await self._run_batch(jobs, "tokenizing", field)
        out: list[list[int]] = []
        for i, (kind, value) in enumerate(replies):
            if kind == "too_long":
                raise PromptTooLong(value, i)
            if kind != "ids":
                raise BatchItemError(i, f"tokenizing failed: {value}")
            out.append(value)
        return out

    async def decode_batch(self, seqs: list[list[int]], *, skip_special_tokens: bool = True,
                           field: str = "tokens") -> list[str]:
        """Text of each id list, in a few jobs (batch_chunks); BatchItemError(index, message) for the first whose
        tokenizer raised."""
        sizes = [len(s) for s in seqs]
        jobs = [(("decode_batch", seqs[r.start:r.stop], skip_special_tokens),
                 sum(sizes[r.start:r.stop]) + ITEM_WEIGHT_IDS * len(r) <= INLINE_IDS, r)
                for r in batch_chunks(sizes, BATCH_IDS)]
        replies = await self._run_batch(jobs, "detokenizing", field)
        out: list[str] = []
        for i, (kind, value) in enumerate(replies):
            if kind != "text":
                raise BatchItemError(i, f"detokenizing failed: {value}")
            out.append(value)
        return out

    async def _run_batch(self, jobs: list[tuple[tuple, bool, range]], what: str, field: str) -> list[tuple[str, Any]]:
        """The replies of a batch's jobs (job, small, the inputs it holds), in input order."""
        def one(job: tuple, small: bool, r: range) -> Any:
            where = f"{what} {field} {r.start}" if len(r) == 1 else f"{what} {field} {r.start}..{r.stop - 1}"
            return self._run(job, small, self.limits.tokenize_timeout, where, field, "--tokenize-timeout")

        replies = await asyncio.gather(*(one(*j) for j in jobs))
        return [item for reply in replies for item in reply[1]]

    async def chat_ids(self, messages: list[dict[str, Any]], *, source: str | None, add_generation_prompt: bool,
                       continue_final_message: bool, variables: dict[str, Any], max_len: int | None) -> list[int]:
        """Render the chat template (the model's, or a client's `source`) and tokenize the prompt."""
        job = ("chat", source, messages, add_generation_prompt, continue_final_message, variables, max_len)
        size = sum(len(str(m.get("content") or "")) for m in messages)
        field = "chat_template_kwargs.chat_template" if source is not None else "messages"
        reply = await self._run(job, source is None and size <= INLINE_CHARS, self.limits.chat_template_timeout,
                                "rendering the chat template", field, "--chat-template-timeout")
        if reply[0] == "template":
            raise APIError(400, f"the messages cannot be rendered with the chat template: {reply[1]}", param=field)
        return self._ids(reply)

    async def parse_json(self, body: bytes) -> Any:
        """json.loads(body); a large body is parsed in a worker process, as the parser holds the
        GIL for its whole run (hundreds of ms for tens of MB) and would stall the event loop."""
        if len(body) <= INLINE_JSON_BYTES or not self.started or self._threads_only or self.tokenizer is None:
            reply = worker_main.parse_json(body)
        else:
            reply = await self._in_process(("json", body), self.limits.tokenize_timeout, "parsing the JSON body", "body",
                                           "--tokenize-timeout")
        if reply[0] == "json_error":
            message, pos = reply[1]
            raise json.JSONDecodeError(message, "", pos)
        return reply[1]

    @staticmethod
    def _ids(reply: tuple[str, Any]) -> list[int]:
        if reply[0] == "too_long":
            raise PromptTooLong(reply[1])
        return reply[1]

    async def _run(self, job: tuple, small: bool, timeout: float, what: str, field: str, flag: str) -> tuple:
        tok = self._tok()
        if small or self._threads_only:
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(self._threads, worker_main.run_job, tok, job)
        else:
            reply = await self._in_process(job, timeout, what, field, flag)
        if reply[0] == "error":
            raise APIError(400, f"{what} failed: {reply[1]}", param=field)
        return reply

    async def _in_process(self, job: tuple, timeout: float, what: str, field: str, flag: str) -> tuple:
        assert self._idle is not None
        try:
            worker = await asyncio.wait_for(self._idle.get(), QUEUE_WAIT_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"the tokenizer workers are all busy; retry later (--tokenizer-workers "
                                f"{self.limits.tokenizer_workers})") from None
        loop = asyncio.get_running_loop()
        try:
            status, reply = await loop.run_in_executor(self._waiters, self._roundtrip, worker, job, timeout)
        except asyncio.CancelledError:  # the client left: the job's result is not wanted, the worker may be busy
            self._replace(worker)
            raise
        if status == "ok":
            self._idle.put_nowait(worker)
            return reply
        self._replace(worker)
        if status == "timeout":
            log.warning("%s took longer than %.1f s (%s): its worker was stopped", what, timeout, flag)
            raise APIError(400, f"{what} took longer than {timeout} s ({flag})", param=field)
        raise APIError(500, f"{what} failed: the worker process died ({reply})", param=field)

    @staticmethod
    def _roundtrip(worker: _Worker, job: tuple, timeout: float) -> tuple[str, Any]:
        """("ok", reply) | ("timeout", None) | ("died", why); on a thread."""
        try:
            if job[0] == "json":  # a large body: its bytes go as they are, the pickled copy would hold the GIL
                worker.conn.send(("json",))
                worker.conn.send_bytes(job[1])
            else:
                worker.conn.send(job)
            if not worker.conn.poll(timeout):
                return "timeout", None
            return "ok", worker.conn.recv()
        except (EOFError, OSError) as e:
            return "died", f"{type(e).__name__}: {e}; exit code {worker.proc.exitcode}"

    def _replace(self, worker: _Worker) -> None:
        """Kill a worker (stuck or dead) and start another, off the event loop."""
        def run() -> None:
            try:
                self._kill(worker)
                self._spawn()
            except Exception as e:  # e.g. the pool closed meanwhile
                if not self._closed:
                    log.warning("replacing a tokenizer worker failed: %s", e)

        threading.Thread(target=run, name="hybridmoe-tokpool-replace", daemon=True).start()
