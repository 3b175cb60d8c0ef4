"""Continuous batching with chunked prefill, prefix reuse and preemption. Pure Python, no tensors.

Every step, each running request computes the next tokens it lacks: one token when decoding,
a chunk of its prompt when prefilling. A request whose step reaches the end of its known tokens
produces logits and gets a new token sampled. Requests join (admission) and leave (finish,
abort, preemption) between any two steps.

A request's tokens needing computation are `all_ids[num_computed:]`; after a preemption its
pages go back to the prefix cache and it re-enters the queue at the front, so resuming costs
only the tokens whose pages were evicted meanwhile.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from hybridmoe.engine import prompt_logprobs
from hybridmoe.engine.kv_cache import KVCacheManager
from hybridmoe.engine.request import Req, ReqState, finish_abort


@dataclass
class ScheduledBatch:
    """One forward pass: for reqs[i], compute num_tokens[i] tokens starting at reqs[i].num_computed."""

    reqs: list[Req]
    num_tokens: list[int]
    sample: list[bool]  # whether reqs[i] gets a token sampled after this step

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Decides each step's batch; owns the waiting queue, the running set and page bookkeeping."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_context_len: int,
        schedule_policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.policy = schedule_policy  # fcfs: arrival order; lpm: longest cached prefix first (_order_lpm)
        self.max_running = max_running_requests
        self.chunk = chunked_prefill_size if chunked_prefill_size > 0 else 1 << 62
        self.max_context_len = max_context_len
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order: oldest first
        self.num_preemptions = 0
        # admission counters (cache hit rate, queue times): read by the engine's stats and metrics
        self.admitted_prompt_tokens = 0  # prompt tokens of first admissions
        self.admitted_cached_tokens = 0  # of them, reused from the prefix cache
        # seconds waited by each first admission, drained by the metrics (bounded: nobody may read them)
        self.queue_times: deque[float] = deque(maxlen=4096)
        self.max_loras: int | None = None  # --max-loras-per-batch when LoRA is on: distinct adapters running at most

    # ---- requests in and out ----
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def add_forked(self, reqs: list[Req]) -> None:
        """Queue sequences forked from a prefilled prompt (holding its shared pages) ahead of the rest."""
        self.waiting.extendleft(reversed(reqs))

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                if req.pages:  # a forked sequence holds its prompt's shared pages while it waits
                    self._release(req)
                req.finish(finish_abort(message))
                return req
        for req in self.running:
            if req.rid == rid:
                self._release(req)
                self.running.remove(req)
                req.finish(finish_abort(message))
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self) -> ScheduledBatch | None:
        """The next batch, or None when there is nothing to run.

        Requests refused or aborted while scheduling come back in the batch with 0 tokens and
        finish_reason set, so the caller can report them.
        """
        entries: list[tuple[Req, int]] = []
        aborted: list[Req] = []
        budget = self.chunk
        # 1. Running requests, oldest first; make room by preempting newer ones.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = min(req.seq_len - req.num_computed, budget)
            if n <= 0:  # out of token budget: this request waits for the next step
                i += 1
                continue
            if self._grow(req, n):
                entries.append((req, n))
                budget -= n
                i += 1
            elif self._preempt_newest(after=i):
                continue  # retry the same request with the freed pages
            elif i > 0:
                self._preempt(req)  # the newest one that needs pages steps back itself
            elif self._drop_waiting_pages():
                continue  # forks waiting held prompt pages (aborting here refused requests that fit the pool)
            else:  # the oldest request alone exceeds the pool
                self.running.pop(0)
                self._release(req)
                req.finish(finish_abort("KV cache too small for this request"))
                aborted.append(req)
        # 2. Admit waiting requests while token budget, slots and pages allow.
        if self.policy == "lpm":
            self._order_lpm()
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.seq_len > self.max_context_len or self.kv.pages_for(req.seq_len) > self.kv.num_pages - 1:
                self.waiting.popleft()
                req.finish(finish_abort(
                    f"request of {req.seq_len} tokens exceeds the context length {self.max_context_len} "
                    f"or the KV cache ({self.kv.capacity_tokens} tokens)"))
                aborted.append(req)
                continue
            if self.max_loras is not None and _too_many_loras(self.running, req, self.max_loras):
                break  # its adapter would exceed --max-loras-per-batch: it waits for a slot
            if not req.pages:  # a forked sequence comes with its prompt's pages
                # a request scoring its prompt reuses no cached page past its next scored position
                req.pages = self.kv.match_prefix(prompt_logprobs.cache_limit(req), namespace=req.lora_key)
                req.num_computed = len(req.pages) * self.kv.page_size
            n = min(req.seq_len - req.num_computed, budget)
            need = self.kv.pages_for(req.num_computed + n) - len(req.pages)
            # Keep a page per running request in reserve so admission does not force preemption.
            if need + len(self.running) > self.kv.num_available() or not self._grow(req, n):
                self._release(req)
                if not self.running and self._drop_waiting_pages():
                    continue  # nothing runs to free pages: waiting forks gave theirs back, retry
                break
            if req.num_preemptions == 0 and req.sample_index == 0:  # a resumed request's reuse is not
                req.cached_tokens = req.num_computed  # prompt caching; a fork reports its prompt's
                self.admitted_prompt_tokens += len(req.prompt_ids)
                self.admitted_cached_tokens += req.cached_tokens
                if req.admit_time is None:
                    req.admit_time = time.time()
                    self.queue_times.append(max(0.0, req.admit_time - req.arrival_time))
            self.waiting.popleft()
            self.running.append(req)
            req.state = ReqState.RUNNING
            entries.append((req, n))
            budget -= n
        if not entries and not aborted:
            return None
        return ScheduledBatch(
            reqs=[r for r, _ in entries] + aborted,
            num_tokens=[n for _, n in entries] + [0] * len(aborted),
            sample=[r.num_computed + n == r.seq_len for r, n in entries] + [False] * len(aborted),
        )

    LPM_MAX_QUEUE = 128  # beyond, matching every waiting prompt each step costs more than it saves: fcfs

    def _order_lpm(self) -> None:
        """Longest prefix match first: waiting requests whose prompt has the most tokens in the prefix
        cache are admitted first (their pages are reused before eviction can take them). Preempted
        requests keep their place at the front; ties keep arrival order (the sort is stable)."""
        if not 2 <= len(self.waiting) <= self.LPM_MAX_QUEUE:
            return
        resumed = [r for r in self.waiting if r.num_preemptions > 0]
        fresh = [r for r in self.waiting if r.num_preemptions == 0]
        fresh.sort(key=lambda r: -self.kv.cached_prefix_len(r.all_ids, namespace=r.lora_key))
        self.waiting = deque(resumed + fresh)

    def _drop_waiting_pages(self) -> bool:
        """Release the pages held by waiting requests (forked sequences holding their prompt's pages,
        queued behind a preempted request); False if none held any. Without it a pool too small for the
        queue's head would wait forever for pages that only requests behind the head hold. The pages go
        to the prefix cache, where the forks find them again."""
        held = [r for r in self.waiting if r.pages]
        for r in held:
            self._release(r)
        return bool(held)

    def _grow(self, req: Req, n: int) -> bool:
        """Give req the pages for n more tokens; False (nothing taken) if the pool is short."""
        pages = self.kv.allocate(self.kv.pages_for(req.num_computed + n) - len(req.pages))
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _preempt_newest(self, after: int) -> bool:
        """Preempt the newest running request with index > after; False if there is none."""
        if len(self.running) <= after + 1:
            return False
        self._preempt(self.running[-1])
        return True

    def _preempt(self, victim: Req) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.state = ReqState.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _release(self, req: Req) -> None:
        self.kv.release(req.pages, req.all_ids[:req.num_computed], namespace=req.lora_key)
        req.pages = []
        req.num_computed = 0

    # ---- after the forward pass ----
    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance each request by the tokens just computed (before new tokens are appended)."""
        for req, n in zip(batch.reqs, batch.num_tokens):
            if n:
                req.num_computed += n

    def finish(self, req: Req, reason: dict) -> None:
        """End a request (stop token, length...) and return its pages to the cache. With overlap
        scheduling a request may end while waiting: preempted by the step scheduled before its last
        token was read."""
        req.finish(reason)
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            if req.pages:
                self._release(req)


def _too_many_loras(running: list[Req], req: Req, limit: int) -> bool:
    """Whether admitting req would make more than `limit` distinct adapters run together."""
    if req.lora_name is None:
        return False
    names = {r.lora_name for r in running if r.lora_name is not None}
    return req.lora_name not in names and len(names) >= limit
