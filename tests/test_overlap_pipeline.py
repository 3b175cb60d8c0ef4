"""Overlap scheduling's bookkeeping, exactly: the real Engine, scheduler, KV manager, sampler and step
pipeline over a fake device whose "KV cache" stores token ids and whose logits are a function of the
tokens read back through the block table. A page handed to two holders, a stale prefix-cache page, a
placeholder resolved to the wrong slot or a token kept from a wasted step changes the tokens (or trips
the fake's own check), so outputs with overlap on must equal those with it off, token for token.

Legend: V vocabulary, B sampled rows.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.future import FutureTokens
from hybridmoe.engine.kv_cache import KVCacheManager
from hybridmoe.engine.request import Req
from hybridmoe.engine.scheduler import ScheduledBatch, Scheduler


class FakeRunner:
    """What the engine needs of a ModelRunner; tokens in, exact logits out."""

    def __init__(self, num_pages: int, page_size: int, vocab: int, max_rows: int, context_len: int) -> None:
        self.device = torch.device("cpu")
        self.page_size, self.vocab, self.context_len = page_size, vocab, context_len
        self.kv = [[None] * page_size for _ in range(num_pages)]
        self.future = FutureTokens(max_rows, self.device)
        self.lora = self.recorder = None
        self.prompt_logprobs: list = []
        self.errors: list[str] = []
        self.forwards = 0

    def check_step_errors(self) -> None:
        pass

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:  # logits [B, V]
        self.forwards += 1
        s = self.page_size
        rows = []
        for r, n, smp in zip(batch.reqs, batch.num_tokens, batch.sample):
            if n <= 0:
                continue
            for p in range(r.num_computed, r.num_computed + n):
                t = r.token_at(p)
                if t < 0:  # a placeholder: what the device ring holds (the runner's resolve)
                    t = int(self.future.ring[-t])
                self.kv[r.pages[p // s]][p % s] = t
            if smp:
                last = r.num_computed + n
                seq = [self.kv[r.pages[q // s]][q % s] for q in range(last)]  # read back through the pages
                truth = [t if t >= 0 else int(self.future.ring[-t]) for t in r.all_ids[:last]]
                if seq != truth:
                    self.errors.append(f"{r.rid}: the KV pages hold {seq[-8:]}, the sequence is {truth[-8:]}")
                rows.append(self._logits(seq))
        return torch.stack(rows) if rows else torch.zeros(0, self.vocab)

    def _logits(self, seq: list) -> torch.Tensor:  # [V]
        h = zlib.crc32(repr(seq).encode())
        return torch.randn(self.vocab, generator=torch.Generator().manual_seed(h))


def _engine(tiny_model_dir, overlap: bool, pages: int, page_size: int = 4, chunk: int = 16,
            max_running: int = 8) -> Engine:
    flag = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    args = EngineArgs(model_path=str(tiny_model_dir("qwen3_moe")), device="cpu", decode_log_interval=0, **flag)
    eng = Engine(args, progress=False)
    assert eng.overlap is overlap
    vocab = eng.model_config.vocab_size
    eng.runner = FakeRunner(pages, page_size, vocab, max_running, context_len=256)  # type: ignore[assignment]
    eng.kv = KVCacheManager(pages, page_size)
    eng.scheduler = Scheduler(eng.kv, max_running, chunk, 256)
    return eng


def _workload(seed: int, vocab: int, n: int = 36, stops: int = 8) -> list[dict]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(m)] for m in (9, 21, 33)]
    out = []
    for i in range(n):
        ids = (rng.choice(prefixes) if rng.random() < 0.5 else []) + [rng.randrange(vocab)
                                                                       for _ in range(rng.randint(1, 30))]
        params: dict = {"max_new_tokens": rng.choice([0, 1, 1, 2, 5, 12, 30]), "temperature": 0.0,
                        "stop_token_ids": rng.sample(range(vocab), stops), "ignore_eos": rng.random() < 0.5}
        kind = rng.random()
        if kind < 0.25:  # seeded sampling: tokens from (seed, output index), whatever the batch
            params.update(temperature=0.9, top_p=0.9, top_k=20, sampling_seed=rng.randrange(1 << 30))
        elif kind < 0.35:  # penalties: the step needs the tokens on the host (synchronous)
            params.update(repetition_penalty=1.3, frequency_penalty=0.2)
        elif kind < 0.42:
            params.update(min_new_tokens=min(3, params["max_new_tokens"]), logit_bias={str(rng.randrange(vocab)): 5.0})
        elif kind < 0.47:
            params.update(n=2, temperature=0.7, sampling_seed=rng.randrange(1 << 30))
        out.append({"rid": f"q{i}", "ids": ids, "params": params, "logprob": rng.random() < 0.1,
                    "arrive": rng.randrange(0, 30)})
    return out


def _run(eng: Engine, work: list[dict], aborts: dict[str, int] | None = None) -> dict[str, Req]:
    """Submit each request at its arrival step, abort some at a given step; run to the end."""
    aborts = aborts or {}
    reqs: dict[str, Req] = {}
    every: dict[str, Req] = {}
    step = 0
    while step < 2000:
        for w in work:
            if w["arrive"] == step:
                r = eng.make_request(input_ids=w["ids"], sampling_params=w["params"], rid=w["rid"],
                                     return_logprob=w["logprob"])
                reqs[w["rid"]] = r
                every.update({s.rid: s for s in [r, *r.forks]})
                eng.submit(r)
        for rid, at in aborts.items():
            if at == step:
                eng.abort(rid)
        eng.step()
        step += 1
        if step > 30 and not eng.has_work():
            break
    assert not eng.has_work(), "the engine did not finish"
    return every


def _cached_prefixes(eng: Engine) -> set[tuple]:
    """Every token prefix the prefix cache holds a page for."""
    out = set()
    for node in eng.kv._node_of.values():
        keys = []
        while node is not None and node.page >= 0:
            keys.append(node.key)
            node = node.parent
        out.add(tuple(reversed(keys)))
    return out


def _check_clean(eng: Engine, reqs: dict[str, Req]) -> None:
    assert not eng.runner.errors, eng.runner.errors[:3]
    assert all(r.finished and not r.pending for r in reqs.values())
    assert eng.kv.num_used() == 0 and not eng.scheduler.running and not eng.scheduler.waiting
    fails = [r.finish_reason for r in reqs.values() if r.finish_reason["type"] == "abort"
             and "aborted by the client" not in r.finish_reason.get("message", "")]
    assert not fails, fails[:3]


@pytest.mark.parametrize("pages,seed", [(400, 1), (32, 2), (26, 3)])
def test_overlap_equals_plain_loop(tiny_model_dir, pages, seed):
    """Mixed workload (lengths, max_new_tokens 0/1, stop ids, EOS, seeded sampling, penalties, logprobs,
    n=2, prefix hits, chunked prefill, staggered arrivals); 32 and 26 pages of 4 tokens preempt."""
    results = {}
    for overlap in (False, True):
        eng = _engine(tiny_model_dir, overlap, pages)
        work = _workload(seed, eng.model_config.vocab_size)
        reqs = _run(eng, work)
        _check_clean(eng, reqs)
        results[overlap] = (reqs, eng)
    (off, e_off), (on, e_on) = results[False], results[True]
    assert set(off) == set(on)
    for rid in off:
        a, b = off[rid], on[rid]
        assert b.output_ids == a.output_ids, rid
        assert b.finish_reason == a.finish_reason, rid
        assert [t for _, t, _ in b.output_logprobs] == [t for _, t, _ in a.output_logprobs]
    assert e_on.pipeline.overlapped_steps > 0
    assert e_off.pipeline.overlapped_steps == 0
    if pages < 30:
        assert e_on.scheduler.num_preemptions > 0 and e_off.scheduler.num_preemptions > 0
    if pages > 100:  # nothing evicted: the prefix cache is the same, the wasted step's KV never cached
        assert _cached_prefixes(e_on) == _cached_prefixes(e_off)


def test_preempted_request_ends_while_waiting(tiny_model_dir, monkeypatch):
    """Overlap: step N+1 is scheduled before step N's tokens are read, so a request preempted by it can
    end (a stop id) while waiting; it leaves the queue with its pages, and nothing else changes."""
    ended_waiting = []
    real = Scheduler.finish

    def finish(self, req, reason):
        if req in self.waiting:
            ended_waiting.append(req.rid)
        real(self, req, reason)

    monkeypatch.setattr(Scheduler, "finish", finish)
    for seed in range(12):  # 16 requests at once, 18 pages of 4: preemption in most decode steps
        rng = random.Random(seed)
        work = [{"rid": f"q{i}", "ids": [rng.randrange(211) for _ in range(rng.randint(3, 20))],
                 "params": {"max_new_tokens": 30, "temperature": 0.0, "stop_token_ids": rng.sample(range(211), 10)},
                 "logprob": False, "arrive": 0} for i in range(16)]
        results = {}
        for overlap in (False, True):
            eng = _engine(tiny_model_dir, overlap, 18)
            results[overlap] = _run(eng, work)
            _check_clean(eng, results[overlap])
            assert eng.scheduler.num_preemptions > 0
        for rid, a in results[False].items():
            assert results[True][rid].output_ids == a.output_ids, (seed, rid)
    assert ended_waiting, "no request ended while preempted: the case is not exercised"


def test_wasted_step_kv_not_cached(tiny_model_dir):
    """A request that stops at step N was computed once more in step N+1 (launched before N's token was
    read): that KV, here filling a page, must not reach the prefix cache."""
    prompt = [3, 1, 4, 1, 5, 9, 2]
    plain = _engine(tiny_model_dir, False, 400)
    ref = plain.make_request(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                "ignore_eos": True})
    plain.submit(ref)
    plain.run_until_done([ref])
    out = ref.output_ids
    # the last token at position L = len(prompt) + k; the wasted step writes position L, the end of a page
    k = next(k for k in range(2, len(out)) if (len(prompt) + k + 1) % 4 == 0 and out[k] not in out[:k])
    caches = {}
    for overlap in (False, True):
        eng = _engine(tiny_model_dir, overlap, 400)
        r = eng.make_request(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                "stop_token_ids": [out[k]], "ignore_eos": True})
        eng.submit(r)
        eng.run_until_done([r])
        while eng.has_work():
            eng.step()
        assert r.output_ids == out[:k + 1] and r.finish_reason == {"type": "stop", "matched": out[k]}
        caches[overlap] = _cached_prefixes(eng)
    assert caches[True] == caches[False] and len(caches[False]) == (len(prompt) + k) // 4


@pytest.mark.parametrize("pages", [400, 20])
def test_abort_mid_flight(tiny_model_dir, pages):
    """Requests aborted while a step of theirs is in flight end at once with their pages freed; what
    they got is a prefix of what they get unaborted, and the others are unchanged."""
    eng = _engine(tiny_model_dir, False, pages)
    work = _workload(7, eng.model_config.vocab_size, n=20)
    ref = _run(eng, work)
    aborts = {w["rid"]: w["arrive"] + k for k, w in zip((1, 2, 3, 5, 8), work[::4])}
    for overlap in (False, True):
        eng = _engine(tiny_model_dir, overlap, pages)
        got = _run(eng, work, aborts)
        _check_clean(eng, got)
        for rid, r in got.items():
            base = rid.split("-")[0]
            if base in aborts and r.finish_reason["type"] == "abort":
                assert r.output_ids == ref[rid].output_ids[:len(r.output_ids)], rid
            else:
                assert r.output_ids == ref[rid].output_ids, rid


def test_failed_step_keeps_nothing(tiny_model_dir, monkeypatch):
    """A step whose CPU-expert check fails (seen after the next step was launched) fails its requests
    and those of the step behind it; their pages go back without the failed KV; the engine goes on."""
    eng = _engine(tiny_model_dir, True, 400)
    calls = {"n": 0}

    def check() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected CPU expert fault")

    monkeypatch.setattr(eng.runner, "check_step_errors", check)
    reqs = [eng.make_request(input_ids=[5, 6, 7, 8, 9] * k, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                            "ignore_eos": True}) for k in (1, 2)]
    for r in reqs:
        eng.submit(r)
    eng.run_until_done(reqs)
    for r in reqs:
        assert r.finish_reason["type"] == "abort" and "injected" in r.finish_reason["message"]
        assert not r.pending
    assert eng.kv.num_used() == 0 and eng.failed_batches == 1
    while eng.has_work():
        eng.step()
    again = eng.make_request(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                           "ignore_eos": True})
    eng.submit(again)
    eng.run_until_done([again])
    plain = _engine(tiny_model_dir, False, 400)
    ref = plain.make_request(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                                           "ignore_eos": True})
    plain.submit(ref)
    plain.run_until_done([ref])
    assert again.output_ids == ref.output_ids and not eng.runner.errors


def test_future_ring_publish_and_resolve():
    """Slots in order, wrap to slot 1 (never onto the previous step's rows), host copies; placeholders
    resolved in any order and mixed with real ids, and a run of consecutive slots as one slice."""
    from hybridmoe.engine.future import placeholder

    f = FutureTokens(max_rows=4, device=torch.device("cpu"))
    assert f.ring.shape[0] == 14
    seen: list[tuple[int, int]] = []
    prev = None
    for step in range(9):
        n = 1 + step % 4
        ids = torch.arange(100 * step, 100 * step + n)
        slot, host = f.publish(ids)
        assert slot >= 1 and slot + n <= f.ring.shape[0]
        if prev is not None:  # never over the rows of the step before (they may not be read yet)
            assert slot >= prev[0] + prev[1] or slot + n <= prev[0]
        prev = (slot, n)
        seen.append((slot, n))
        assert host.read() == ids.tolist()
        mixed = [7, placeholder(slot + n - 1), 3] + [placeholder(slot + i) for i in range(n)]
        got = f.resolve(torch.tensor(mixed), mixed)
        assert got.tolist() == [7, ids[-1].item(), 3] + ids.tolist()
        run = [placeholder(slot + i) for i in range(n)]
        assert f.resolve(torch.tensor(run), run).tolist() == ids.tolist()
        buf = torch.tensor(run[::-1] + [5])
        f.resolve_(buf, run[::-1] + [5])
        assert buf.tolist() == ids.tolist()[::-1] + [5]
    assert any(s == 1 for s, _ in seen[1:])  # it wrapped
    with pytest.raises(ValueError):
        f.publish(torch.arange(5))
