"""Scheduler and KV bookkeeping, pure Python: no model, fake sampled tokens."""

from __future__ import annotations

import random

import pytest

from hybridmoe.engine.kv_cache import KVCacheManager
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.engine.scheduler import Scheduler


def _req(rid: str, n: int, max_new: int, seed: int = 0) -> Req:
    rng = random.Random(seed)
    return Req(rid=rid, prompt_ids=[rng.randrange(1000) for _ in range(n)], params=SamplingParams(max_new_tokens=max_new))


def _run(sched: Scheduler, reqs: list[Req], max_steps: int = 10_000) -> list[list[tuple[str, int]]]:
    """Drive the scheduler like the engine does, sampling token 7; returns each step's (rid, n)."""
    for r in reqs:
        sched.add(r)
    steps = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        steps.append([(r.rid, n) for r, n in zip(batch.reqs, batch.num_tokens)])
        # invariants: pages cover the tokens to be computed, and nobody shares an owned page
        for r, n in zip(batch.reqs, batch.num_tokens):
            if n:
                assert len(r.pages) * sched.kv.page_size >= r.num_computed + n
        sched.on_step_done(batch)
        for r, smp in zip(batch.reqs, batch.sample):
            if smp:
                r.output_ids.append(7)
                if len(r.output_ids) >= r.params.max_new_tokens:
                    sched.finish(r, {"type": "length", "length": len(r.output_ids)})
        assert len(steps) < max_steps
    return steps


def test_chunked_prefill_and_continuous_batching():
    kv = KVCacheManager(num_pages=200, page_size=4)
    sched = Scheduler(kv, max_running_requests=8, chunked_prefill_size=10, max_context_len=500)
    reqs = [_req("a", 25, 3), _req("b", 4, 5, 1)]
    steps = _run(sched, reqs)
    # a: 25 tokens in chunks of at most 10 (the budget is shared with b)
    assert steps[0] == [("a", 10)]
    assert steps[1] == [("a", 10)]
    assert steps[2] == [("a", 5), ("b", 4)]  # b joins while a finishes its prompt
    assert all(n == 1 for step in steps[3:] for _, n in step)  # then both decode together
    assert all(r.finished and len(r.output_ids) == r.params.max_new_tokens for r in reqs)
    assert kv.num_used() == 0


def test_max_running_requests_limits_the_batch():
    kv = KVCacheManager(num_pages=500, page_size=4)
    sched = Scheduler(kv, max_running_requests=3, chunked_prefill_size=1000, max_context_len=500)
    reqs = [_req(f"r{i}", 5, 4, i) for i in range(7)]
    steps = _run(sched, reqs)
    assert max(len(s) for s in steps) == 3
    assert all(r.finished for r in reqs)


def test_preemption_when_pages_run_out_loses_no_request():
    kv = KVCacheManager(num_pages=9, page_size=4)  # 32 tokens of pool
    sched = Scheduler(kv, max_running_requests=8, chunked_prefill_size=64, max_context_len=32)
    reqs = [_req(f"r{i}", 6, 10, i) for i in range(5)]
    _run(sched, reqs)
    assert sched.num_preemptions > 0
    assert all(r.finished and r.finish_reason["type"] == "length" for r in reqs)
    assert all(len(r.output_ids) == 10 for r in reqs)
    assert kv.num_used() == 0


def test_request_too_large_for_pool_is_refused_not_stuck():
    kv = KVCacheManager(num_pages=5, page_size=4)
    sched = Scheduler(kv, max_running_requests=8, chunked_prefill_size=64, max_context_len=100)
    big, small = _req("big", 40, 2), _req("small", 3, 2, 1)
    _run(sched, [big, small])
    assert big.finish_reason["type"] == "abort" and "exceeds" in big.finish_reason["message"]
    assert small.finish_reason["type"] == "length"


def test_the_oldest_request_takes_the_pages_of_waiting_forks_before_an_abort():
    """A running request that cannot grow with no newer one to preempt was aborted "KV cache too small" even
    when the pages it lacked were held by forked sequences waiting with their prompt's pages (n > 1); they give
    them back (to the prefix cache) first, as admission does. Found by tests/test_engine_stress.py's workload."""
    kv = KVCacheManager(num_pages=9, page_size=1)  # 8 usable pages
    sched = Scheduler(kv, max_running_requests=1, chunked_prefill_size=64, max_context_len=64)
    a = _req("a", 4, 4)
    sched.add(a)
    batch = sched.schedule()  # a's prompt: 4 pages
    sched.on_step_done(batch)
    a.output_ids.append(7)
    fork = _req("f", 3, 2, 1)
    fork.pages, fork.num_computed = kv.allocate(2), 2  # parallel.fork: the prompt's full pages but the last token
    _run(sched, [fork])  # a needs pages 5-7 while the fork waits (one running request at a time)
    assert a.finish_reason == {"type": "length", "length": 4}
    assert fork.finish_reason == {"type": "length", "length": 2}
    assert kv.num_used() == 0


def test_prefix_match_reports_cached_tokens_and_shares_pages():
    kv = KVCacheManager(num_pages=100, page_size=4)
    sched = Scheduler(kv, max_running_requests=8, chunked_prefill_size=64, max_context_len=200)
    first = _req("a", 18, 1)
    _run(sched, [first])
    second = Req(rid="b", prompt_ids=first.prompt_ids[:17] + [1, 2], params=SamplingParams(max_new_tokens=1))
    _run(sched, [second])
    assert second.cached_tokens == 16  # 4 full pages of the shared 17 tokens
    exact = Req(rid="c", prompt_ids=list(first.prompt_ids[:16]), params=SamplingParams(max_new_tokens=1))
    _run(sched, [exact])
    assert exact.cached_tokens == 12  # the last token is always computed: 3 pages


def test_abort_frees_pages():
    kv = KVCacheManager(num_pages=50, page_size=4)
    sched = Scheduler(kv, max_running_requests=8, chunked_prefill_size=64, max_context_len=200)
    r = _req("a", 20, 100)
    sched.add(r)
    batch = sched.schedule()
    sched.on_step_done(batch)
    assert kv.num_used() > 0
    assert sched.abort("a") is r
    assert r.finish_reason["type"] == "abort"
    assert kv.num_used() == 0 and not sched.has_work()


def test_kv_eviction_is_lru_and_leaf_first():
    kv = KVCacheManager(num_pages=7, page_size=2)  # 6 usable pages
    a = kv.allocate(3)
    kv.release(a, [1, 2, 3, 4, 5, 6])  # cached chain of 3 pages
    b = kv.allocate(2)
    kv.release(b, [9, 9, 8, 8])  # a second chain of 2
    assert kv.num_available() == 6 and kv.num_cached() == 5
    hit = kv.match_prefix([9, 9, 8, 8, 0])  # touch chain b
    assert hit == b
    kv.release(hit, [9, 9, 8, 8])
    got = kv.allocate(3)  # 1 free + evict 2: the LRU chain a, from its leaf up
    assert got is not None and len(got) == 3
    assert kv.match_prefix([1, 2, 3, 4, 5, 6, 0]) == [a[0]]  # only a's first page survives
    assert kv.match_prefix([9, 9, 8, 8, 0]) == b


def test_shared_pages_of_a_duplicate_prefix_leave_every_idle_page_evictable():
    """A request that computed a cached prefix again (it started before the cache had it) releases under the
    cached copy's nodes. A page of its that a fork still holds was cached there too: the copy's nodes went idle
    with a held child, counted available yet never a leaf, and allocate raised "prefix cache accounting error:
    nothing to evict" (found by tests/test_engine_stress.py's workload)."""
    kv = KVCacheManager(num_pages=9, page_size=1)  # 8 usable pages
    b = kv.allocate(3)  # tokens [1, 2, 5], computed before the cache held [1, 2]
    x = kv.allocate(2)
    kv.release(x, [1, 2])  # the cached copy: idle nodes x0 -> x1
    fork = kv.share(b)  # n > 1: the fork holds all of b's prompt pages
    kv.release(b, [1, 2, 5])  # follows x0 -> x1; b's pages are freed or stay the fork's
    assert kv.num_available() == 5  # 3 free + x0, x1 idle
    got = kv.allocate(kv.num_available())
    assert got is not None and len(got) == 5
    kv.release(got, [])
    kv.release(fork, [1, 2, 5, 6])
    assert kv.num_used() == 0 and kv.allocate(8) is not None


def test_release_more_than_taken_is_an_error():
    kv = KVCacheManager(num_pages=4, page_size=2)
    p = kv.allocate(1)
    kv.release(p, [])
    with pytest.raises(RuntimeError):
        kv.release(p, [])


def test_ids_between_is_a_slice_of_all_ids():
    """Req.ids_between(start, stop) == all_ids[start:stop] for every range, with and without output and
    pending placeholders (the runner reads a step's tokens with it, not the whole sequence)."""
    rng = random.Random(3)
    for _ in range(200):
        req = Req(rid="r", prompt_ids=[rng.randrange(100) for _ in range(rng.randrange(0, 6))],
                  params=SamplingParams(), output_ids=[rng.randrange(100) for _ in range(rng.randrange(0, 5))])
        req.pending = [-(i + 1) for i in range(rng.randrange(0, 3))]
        full = req.all_ids
        for start in range(len(full) + 2):
            for stop in range(start, len(full) + 3):
                assert req.ids_between(start, stop) == full[start:stop], (req, start, stop)
