"""Sampler: each option against a direct reference computation on synthetic logits."""

from __future__ import annotations

import math

import pytest
import torch

from hybridmoe.engine.request import Req, SamplingParams, SamplingParamsError
from hybridmoe.engine.sampler import NAN_ROW, Sampler


def _req(rid="r", out=(), prompt=(1,), **params) -> Req:
    return Req(rid=rid, prompt_ids=list(prompt), params=SamplingParams(**params), output_ids=list(out))


def _freqs(logits, req, n=4000):
    s = Sampler(logits.shape[-1], [])
    reqs = [req] * n
    ids = s(logits.expand(n, -1).clone(), reqs).next_ids
    return torch.bincount(torch.tensor(ids), minlength=logits.shape[-1]).float() / n


def test_greedy_and_temperature_zero():
    logits = torch.randn(3, 50)
    s = Sampler(50, [])
    reqs = [_req(temperature=0.0), _req(top_k=1), _req(temperature=0.0, top_p=0.5)]
    assert s(logits, reqs).next_ids == logits.argmax(-1).tolist()


def test_plain_greedy_fast_path_matches_full_path():
    """An all-greedy batch without penalties or logprobs takes one argmax (padded vocab rows
    ignored); a batch that also needs logprobs goes the full way: same tokens either way."""
    torch.manual_seed(3)
    logits = torch.randn(5, 61).to(torch.bfloat16)
    logits[:, 57:] = 100.0  # padding columns beyond the vocabulary must never win
    s = Sampler(57, [])
    fast = s(logits, [_req(temperature=0.0) for _ in range(5)])
    assert fast.logprobs is None
    full = s(logits, [_req(temperature=0.0) for _ in range(4)] + [Req(rid="lp", prompt_ids=[1], params=SamplingParams(
        temperature=0.0), return_logprob=True)])
    assert fast.next_ids == full.next_ids == logits[:, :57].float().argmax(-1).tolist()
    assert not Sampler._plain_greedy(_req(temperature=0.0, min_new_tokens=2))  # EOS still banned
    assert not Sampler._plain_greedy(_req(temperature=0.0, repetition_penalty=1.2))


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    f = _freqs(logits, _req(temperature=0.7))
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (f - expected).abs().max() < 0.03


def test_top_k_top_p_min_p_support():
    torch.manual_seed(1)
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]])
    assert set(_freqs(logits, _req(top_k=2)).nonzero().flatten().tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)  # [0.47, 0.29, 0.17, ...]
    # top_p: keep the smallest prefix whose mass reaches p
    assert set(_freqs(logits, _req(top_p=0.7)).nonzero().flatten().tolist()) == {0, 1}
    assert set(_freqs(logits, _req(top_p=0.8)).nonzero().flatten().tolist()) == {0, 1, 2}
    # min_p: keep tokens with prob >= min_p * max prob
    keep = {i for i in range(6) if p[i] >= 0.3 * p[0]}
    assert set(_freqs(logits, _req(min_p=0.3)).nonzero().flatten().tolist()) == keep


def test_penalties_match_reference_formulas():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 0.0]])
    r = _req(out=[0, 0, 1], prompt=[3], temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
             presence_penalty=0.25)
    got = Sampler(5, [])._apply_penalties(logits.clone(), [r])
    ref = logits.clone()[0]
    for t in (0, 1, 3):  # seen in prompt or output
        ref[t] = ref[t] / 2.0 if ref[t] > 0 else ref[t] * 2.0
    ref[0] -= 0.5 * 2 + 0.25
    ref[1] -= 0.5 * 1 + 0.25
    assert torch.allclose(got[0], ref)


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])
    s = Sampler(4, [1])
    assert s(logits, [_req(temperature=0.0, min_new_tokens=2, stop_token_ids=[2])]).next_ids == [3]
    assert s(logits, [_req(out=[3, 3], temperature=0.0, min_new_tokens=2)]).next_ids == [1]


def test_seed_is_reproducible_and_batch_independent():
    logits = torch.randn(1, 100)
    s = Sampler(100, [])
    alone = s(logits, [_req(sampling_seed=42)]).next_ids[0]
    mixed = s(torch.cat([torch.randn(3, 100), logits]), [_req(), _req(), _req(), _req(sampling_seed=42)])
    assert mixed.next_ids[3] == alone
    draws = {s(logits, [_req(out=[5] * k, sampling_seed=42)]).next_ids[0] for k in range(20)}
    assert len(draws) > 1  # the noise moves with the step


def test_logprobs_and_top_logprobs():
    logits = torch.randn(2, 30)
    s = Sampler(30, [])
    reqs = [_req(temperature=0.0), _req(temperature=0.0)]
    reqs[0].return_logprob, reqs[0].top_logprobs_num = True, 3
    out = s(logits, reqs)
    lp = torch.log_softmax(logits, -1)
    assert math.isclose(out.logprobs[0], lp[0, out.next_ids[0]].item(), rel_tol=1e-5)
    vals, idx = lp[0].topk(3)
    assert [t for _, t in out.top_logprobs[0]] == idx.tolist()
    assert out.top_logprobs[1] == []


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"max_new_tokens": -1},
    {"stop": [1, 2]}, {"stop": [""]}, {"min_p": 2.0}, {"repetition_penalty": 0.0}, {"max_new_tokens": "5"},
])
def test_invalid_params_name_the_field(bad):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_any(bad).validate(100)
    assert next(iter(bad)) in str(e.value)


def test_unknown_param_is_refused():
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter"):
        SamplingParams.from_any({"temprature": 1.0})


def test_wait_event_is_for_cuda_results_only():
    """The hybrid engine's sleeping wait (Sampler.wait_event) is recorded only for CUDA results;
    CPU results are read as they are, with the same ids."""
    calls = []

    class Ev:
        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("sync")

    logits = torch.randn(3, 57)
    s = Sampler(57, [])
    plain = s(logits, [_req(temperature=0.0) for _ in range(3)])
    s.wait_event = Ev()
    assert s(logits, [_req(temperature=0.0) for _ in range(3)]).next_ids == plain.next_ids
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the native argmax on the CPU
@pytest.mark.parametrize("mode", ["greedy", "sampled", "logprobs", "bias"])
def test_nan_rows_are_marked(dtype, mode):
    """A row with one NaN or +inf logit anywhere (the first, the last, a middle column) is sampled as NAN_ROW on
    every path (sampling drew token 0 from the NaN probabilities of +inf); rows without keep the ids they get
    alone (-inf is a mask, not an error); padding columns beyond the vocabulary are not looked at."""
    torch.manual_seed(5)
    v = 67
    logits = torch.randn(6, v + 3).to(dtype)
    logits[:, v:] = float("nan")  # padding: ignored
    logits[1, 0] = logits[3, v - 1] = logits[4, 30] = float("nan")
    logits[2, 10] = float("inf")  # (bf16 overflows to inf)
    logits[5, :] = float("-inf")
    logits[5, 7] = 0
    params = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.9, "sampling_seed": 4},
              "logprobs": {"temperature": 0.0}, "bias": {"temperature": 0.0, "logit_bias": {"3": 0.5}}}[mode]
    reqs = [Req(rid=str(i), prompt_ids=[1], params=SamplingParams(**params), return_logprob=mode == "logprobs")
            for i in range(6)]
    s = Sampler(v, [])
    out = s(logits, reqs)
    assert [i for i, t in enumerate(out.next_ids) if t == NAN_ROW] == [1, 2, 3, 4]
    for i in (0, 5):  # the same as alone, without the marked rows beside
        assert out.next_ids[i] == s(logits[i:i + 1], reqs[i:i + 1]).next_ids[0]
    assert out.next_ids[5] == 7
    assert s.sample_ids(logits, reqs).tolist() == out.next_ids  # the overlap path: the same marks
    if mode == "logprobs":
        assert math.isnan(out.logprobs[1]) and out.logprobs[0] <= 0


def test_nan_row_is_no_token_and_no_placeholder():
    from hybridmoe.engine.future import FutureTokens

    f = FutureTokens(max_rows=4, device=torch.device("cpu"))
    assert NAN_ROW < -f.ring.shape[0] * 1000
    slot, host = f.publish(torch.tensor([5, NAN_ROW, 9]))
    assert host.read() == [5, NAN_ROW, 9]  # the host sees the mark
    assert f.ring[slot:slot + 3].tolist() == [5, 0, 9]  # the device ring a valid id
