"""Engine-level behaviour: batching invariance, chunked prefill, a small KV pool, prefix reuse."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def _prompts(vocab: int, n: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    lengths = [1, 3, 7, 12, 16, 17, 25, 31, 33, 40, 47, 64, 65, 80, 99, 120][:n]
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    llm = LLM(str(path), device="cpu", progress=False, disable_radix_cache=True)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    alone = [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    return path, prompts, alone


def test_batched_equals_alone_with_chunked_prefill(reference):
    path, prompts, alone = reference
    llm = LLM(str(path), device="cpu", progress=False, chunked_prefill_size=48, disable_radix_cache=True)
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == alone


def test_small_kv_pool_preempts_and_completes(reference):
    path, prompts, alone = reference
    # 12 pages of 16 tokens: far less than the 16 requests need together (~1.5k tokens).
    llm = LLM(str(path), device="cpu", progress=False, chunked_prefill_size=32, max_total_tokens=12 * 16,
              page_size=16)
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == alone
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert llm.engine.kv.num_used() == 0


def test_prefix_cache_reuse(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    vocab = 211
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, vocab, (200,), generator=g).tolist()
    second = prefix + torch.randint(0, vocab, (9,), generator=g).tolist()
    first = prefix + torch.randint(0, vocab, (5,), generator=g).tolist()
    cached = LLM(str(path), device="cpu", progress=False)
    a = cached.generate(input_ids=first, sampling_params=GREEDY)
    assert a["meta_info"]["cached_tokens"] == 0
    b = cached.generate(input_ids=second, sampling_params=GREEDY)
    assert b["meta_info"]["cached_tokens"] >= 192
    nocache = LLM(str(path), device="cpu", progress=False, disable_radix_cache=True)
    c = nocache.generate(input_ids=second, sampling_params=GREEDY)
    assert c["meta_info"]["cached_tokens"] == 0
    assert b["output_ids"] == c["output_ids"]
