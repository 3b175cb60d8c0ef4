"""--schedule-policy: fcfs admits in arrival order; lpm admits the waiting request with the longest
cached prefix first (preempted requests keep the front). Pure Python: scheduler and KV bookkeeping."""

from __future__ import annotations

import pytest

from hybridmoe.engine.kv_cache import KVCacheManager
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.engine.scheduler import Scheduler

SHARED = list(range(100, 124))  # 24 tokens: 6 pages of 4


def _req(rid: str, ids: list[int], max_new: int = 1) -> Req:
    return Req(rid=rid, prompt_ids=ids, params=SamplingParams(max_new_tokens=max_new))


def _finish_all(sched: Scheduler) -> list[str]:
    """Run to the end, sampling token 7; the rids in the order they were first scheduled."""
    order: list[str] = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        for r in batch.reqs:
            if r.rid not in order:
                order.append(r.rid)
        sched.on_step_done(batch)
        for r, smp in zip(batch.reqs, batch.sample):
            if smp:
                r.output_ids.append(7)
                if len(r.output_ids) >= r.params.max_new_tokens:
                    sched.finish(r, {"type": "length", "length": len(r.output_ids)})
    return order


def _warm(policy: str) -> Scheduler:
    """A scheduler (one request at a time) whose prefix cache holds SHARED."""
    kv = KVCacheManager(num_pages=64, page_size=4)
    sched = Scheduler(kv, max_running_requests=1, chunked_prefill_size=64, max_context_len=200,
                      schedule_policy=policy)
    sched.add(_req("warm", SHARED + [1, 2]))
    assert _finish_all(sched) == ["warm"]
    return sched


@pytest.mark.parametrize("policy,want", [("fcfs", ["cold1", "cold2", "hot_short", "hot_long"]),
                                         ("lpm", ["hot_long", "hot_short", "cold1", "cold2"])])
def test_admission_order(policy: str, want: list[str]) -> None:
    sched = _warm(policy)
    for rid, ids in (("cold1", list(range(500, 530))), ("cold2", list(range(600, 610))),
                     ("hot_short", SHARED[:9] + [9, 9, 9]), ("hot_long", SHARED + [3, 3])):
        sched.add(_req(rid, ids))
    assert _finish_all(sched) == want


def test_lpm_keeps_preempted_requests_first() -> None:
    sched = _warm("lpm")
    resumed = _req("resumed", list(range(700, 720)))
    resumed.num_preemptions = 1  # as _preempt leaves it, at the front of the queue
    sched.waiting.appendleft(resumed)
    sched.add(_req("hot", SHARED + [4]))
    assert _finish_all(sched) == ["resumed", "hot"]


def test_cached_prefix_len_takes_no_reference() -> None:
    sched = _warm("lpm")
    kv = sched.kv
    before = kv.num_available()
    assert kv.cached_prefix_len(SHARED + [1]) == 24
    assert kv.cached_prefix_len(SHARED) == 20  # at least one token is left to compute, as match_prefix
    assert kv.cached_prefix_len(SHARED[:7]) == 4
    assert kv.cached_prefix_len([1, 2, 3, 4, 5]) == 0
    assert kv.cached_prefix_len([]) == 0
    assert kv.num_available() == before
    assert len(kv.match_prefix(SHARED + [1])) * 4 == 24
    assert KVCacheManager(8, 4, enable_prefix_cache=False).cached_prefix_len(SHARED) == 0
