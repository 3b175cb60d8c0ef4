"""Prompt logprobs and n > 1 in the engine, against transformers on a tiny random model (fp32)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM
from hybridmoe.engine.engine import RequestError

from tiny_models import hf_model

VOCAB = 211


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def ref(path):
    return hf_model(path)


@pytest.fixture(scope="module")
def llm(path):  # small chunks and pages: prompts span several of each
    return LLM(str(path), device="cpu", progress=False, chunked_prefill_size=24, page_size=8)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_logprobs(ref, ids: list[int]) -> list[float]:
    """log p(ids[p] | ids[:p]) for p >= 1, by transformers."""
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def _score(llm, ids, start=0, top=0, **params):
    return llm.generate(input_ids=ids, sampling_params=dict({"max_new_tokens": 0}, **params), return_logprob=True,
                        logprob_start_len=start, top_logprobs_num=top)


def test_prompt_logprobs_match_transformers_across_chunks(llm, ref):
    ids = _ids(61, 1)  # 3 chunks of 24, 8 pages
    out = _score(llm, ids, top=3)
    meta = out["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids and got[0][0] is None
    want = _ref_logprobs(ref, ids)
    assert max(abs(a[0] - b) for a, b in zip(got[1:], want)) < 1e-4
    assert abs(sum(a[0] for a in got[1:]) - sum(want)) < 1e-4
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(t) == 3 for t in tops[1:])
    assert all(t[0][0] >= lp for t, (lp, _, _) in zip(tops[1:], got[1:]))
    assert llm.engine.kv.num_used() == 0


def test_prompt_logprobs_from_a_start_and_with_a_prefix_cache_hit(llm, ref):
    ids = _ids(45, 2)
    want = _ref_logprobs(ref, ids)
    _score(llm, ids)  # caches the prompt's full pages
    cached = llm.engine.kv.num_cached()
    assert cached >= 5
    again = _score(llm, ids)
    assert again["meta_info"]["cached_tokens"] == 0  # scored from position 0: no page reused
    got = again["meta_info"]["input_token_logprobs"]
    assert max(abs(a[0] - b) for a, b in zip(got[1:], want)) < 1e-4
    part = _score(llm, ids, start=30)  # a cached prefix up to the scored part is reused
    assert 0 < part["meta_info"]["cached_tokens"] <= 30
    got = part["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[30:] and got[0][0] is None
    assert max(abs(a[0] - b) for a, b in zip(got[1:], want[30:])) < 1e-4
    # with generated tokens too, in a batch with a request that does not score
    both = llm.generate(input_ids=[ids, _ids(20, 3)], sampling_params={"max_new_tokens": 3, "temperature": 0},
                        return_logprob=True, logprob_start_len=0)
    got = both[0]["meta_info"]["input_token_logprobs"]
    assert max(abs(a[0] - b) for a, b in zip(got[1:], want)) < 1e-4
    assert len(both[0]["meta_info"]["output_token_logprobs"]) == 3


def test_max_new_tokens_zero_caches_the_prompt(llm):
    llm.engine.flush_cache()
    ids = _ids(40, 4)
    out = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["prompt_tokens"] == 40
    assert llm.engine.kv.num_cached() == 5  # its 5 full pages are kept
    again = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == 32  # a lookup leaves the last token to compute: 4 pages


def test_bad_logprob_start_len(llm):
    for bad in (-2, 10, 1.5):
        with pytest.raises(RequestError, match="logprob_start_len"):
            llm.generate(input_ids=_ids(10, 5), return_logprob=True, logprob_start_len=bad)


def test_n_sequences_share_the_prompt_pages_and_seed(llm):
    llm.engine.flush_cache()
    ids = _ids(43, 6)  # 5 full pages + 3 tokens
    params = {"n": 4, "max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    reqs = llm.engine.make_request(input_ids=ids, sampling_params=params)
    every = [reqs, *reqs.forks]
    llm.engine.submit(reqs)
    peak = 0
    while not all(r.finished for r in every):
        llm.engine.step()
        peak = max(peak, llm.engine.kv.num_used())
    # 4 separate copies would hold 4 * 7 pages; shared: 5 prompt pages + 2 own pages per sequence
    assert peak <= 5 + 4 * 2
    assert llm.engine.kv.num_used() == 0
    first = [r.output_ids for r in every]
    assert len(first) == 4 and all(len(o) == 6 for o in first)
    again = [o["output_ids"] for o in llm.generate(input_ids=ids, sampling_params=params)]
    assert again == first
    assert len({tuple(o) for o in first}) > 1  # the sequences differ
    one = llm.generate(input_ids=ids, sampling_params=dict(params, n=1))["output_ids"]
    assert one == first[0]  # sequence 0 samples on the seed's own stream
    unseeded = [o["output_ids"] for o in llm.generate(input_ids=ids, sampling_params=dict(params, sampling_seed=None))]
    assert len(unseeded) == 4 and unseeded != first


def test_n_with_a_batch_and_prompt_logprobs(llm, ref):
    a, b = _ids(17, 8), _ids(9, 9)
    outs = llm.generate(input_ids=[a, b], sampling_params={"n": 3, "max_new_tokens": 2}, return_logprob=True,
                        logprob_start_len=0)
    assert len(outs) == 6 and [o["meta_info"]["prompt_tokens"] for o in outs] == [17] * 3 + [9] * 3
    want = _ref_logprobs(ref, a)
    for o in outs[:3]:
        got = o["meta_info"]["input_token_logprobs"]
        assert max(abs(x[0] - y) for x, y in zip(got[1:], want)) < 1e-4
    zero = llm.generate(input_ids=a, sampling_params={"n": 2, "max_new_tokens": 0})
    assert [o["output_ids"] for o in zero] == [[], []]
    assert llm.engine.kv.num_used() == 0


def test_lm_head_in_small_row_chunks(llm, ref, monkeypatch):
    from hybridmoe.engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "MAX_CHUNK_ELEMENTS", VOCAB * 5)  # 5 rows per chunk, odd remainders
    ids = _ids(33, 10)
    got = _score(llm, ids, start=2, top=2)["meta_info"]["input_token_logprobs"]
    want = _ref_logprobs(ref, ids)[2:]
    assert len(got) == 31 and max(abs(a[0] - b) for a, b in zip(got[1:], want)) < 1e-4


def _run(engine, reqs):
    while not all(r.finished for r in reqs):
        engine.step()


def test_aborts_before_the_fork(llm):
    engine = llm.engine
    params = {"n": 3, "max_new_tokens": 4, "ignore_eos": True}
    req = engine.make_request(input_ids=_ids(61, 11), sampling_params=params)  # 3 prefill steps
    every = [req, *req.forks]
    engine.submit(req)
    engine.step()
    engine.abort(req.rid, "stop")  # the first sequence ends mid-prefill: the forks end with it
    _run(engine, every)
    assert [r.finish_reason["type"] for r in every] == ["abort"] * 3
    req = engine.make_request(input_ids=_ids(30, 12), sampling_params=params)
    every = [req, *req.forks]
    engine.submit(req)
    engine.abort(every[2].rid, "just this one")  # a fork aborted before it started
    _run(engine, every)
    assert [r.finish_reason["type"] for r in every] == ["length", "length", "abort"]
    assert engine.kv.num_used() == 0 and not engine.has_work()


def test_prompt_logprobs_survive_preemption(path, ref):
    small = LLM(str(path), device="cpu", progress=False, chunked_prefill_size=24, page_size=8, max_total_tokens=80)
    a, b = _ids(30, 13), _ids(40, 14)
    outs = small.generate(input_ids=[a, b], sampling_params={"max_new_tokens": 30, "ignore_eos": True,
                                                             "temperature": 0}, return_logprob=True,
                          logprob_start_len=0)
    assert small.engine.scheduler.num_preemptions > 0
    for ids, out in zip((a, b), outs):
        got = out["meta_info"]["input_token_logprobs"]
        assert len(got) == len(ids) and [t for _, t, _ in got] == ids
        assert max(abs(x[0] - y) for x, y in zip(got[1:], _ref_logprobs(ref, ids))) < 1e-4
        assert len(out["output_ids"]) == 30
