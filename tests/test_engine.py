"""Engine behaviour through the offline API: seeds, streaming, abort, logprobs, limits."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.engine.engine import RequestError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen3_moe")), device="cpu", progress=False, chunked_prefill_size=40)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeded_sampling_same_alone_and_batched(llm):
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 16, "sampling_seed": 1234, "ignore_eos": True}
    prompt = _ids(20, 1)
    alone = llm.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    others = [_ids(n, s) for n, s in ((5, 2), (33, 3), (50, 4))]
    batch = llm.generate(input_ids=others + [prompt],
                         sampling_params=[{"temperature": 1.0, "max_new_tokens": 12}] * 3 + [params])
    assert batch[3]["output_ids"] == alone
    again = llm.generate(input_ids=prompt, sampling_params=SamplingParams(**params))["output_ids"]
    assert again == alone
    other_seed = llm.generate(input_ids=prompt, sampling_params=dict(params, sampling_seed=99))["output_ids"]
    assert other_seed != alone


def test_stream_is_cumulative_and_ends_with_finish_reason(llm):
    prompt = _ids(9, 5)
    params = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True}
    full = llm.generate(input_ids=prompt, sampling_params=params)
    chunks = list(llm.generate(input_ids=prompt, sampling_params=params, stream=True))
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 8))
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_abandoned_stream_frees_its_pages(llm):
    it = llm.generate(input_ids=_ids(30, 6), sampling_params={"max_new_tokens": 50, "ignore_eos": True},
                      stream=True)
    next(it)
    assert llm.engine.kv.num_used() > 0
    it.close()
    assert llm.engine.kv.num_used() == 0 and not llm.engine.has_work()


def test_stop_token_ids_and_min_new_tokens(llm):
    prompt = _ids(12, 7)
    ref = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                          "ignore_eos": True})["output_ids"]
    stop_at = ref[3]
    first = ref.index(stop_at)
    out = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                          "stop_token_ids": [stop_at]})
    assert out["output_ids"] == ref[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    later = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                            "stop_token_ids": [stop_at], "min_new_tokens": first + 2})
    assert len(later["output_ids"]) > first + 1


def test_logprobs_are_log_softmax_of_prompt_logits(llm):
    prompt = _ids(15, 8)
    out = llm.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                       return_logprob=True, top_logprobs_num=4)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 4
    lp = torch.log_softmax(llm.prompt_logits(prompt)[-1], -1)
    first_lp, first_id, _ = meta["output_token_logprobs"][0]
    assert first_id == out["output_ids"][0] == int(lp.argmax())
    assert abs(first_lp - lp[first_id].item()) < 1e-4
    assert [t for _, t, _ in meta["output_top_logprobs"][0]] == lp.topk(4).indices.tolist()


def test_bad_requests_raise_request_error(llm):
    with pytest.raises(RequestError, match="empty"):
        llm.generate(input_ids=[], sampling_params={})
    with pytest.raises(RequestError, match="token ids"):
        llm.generate(input_ids=[1, 10_000], sampling_params={})
    with pytest.raises(RequestError, match="context length"):
        llm.generate(input_ids=[1] * 5000, sampling_params={})
    with pytest.raises(RequestError, match="temperature"):
        llm.generate(input_ids=[1, 2], sampling_params={"temperature": -1})
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(prompt="hello")
    ok = llm.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert len(ok["output_ids"]) == 2


def test_max_new_tokens_zero_and_context_cap(llm):
    out = llm.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    ctx = llm.engine.context_len
    near = llm.generate(input_ids=[1] * (ctx - 3), sampling_params={"max_new_tokens": 100, "ignore_eos": True})
    assert len(near["output_ids"]) == 3
