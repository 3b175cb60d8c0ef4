"""Prompt logprobs and n > 1 on the GPU, with decode CUDA graphs on (GPU only)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM

from tiny_models import hf_model

pytestmark = pytest.mark.gpu


def test_prompt_logprobs_and_n_with_cuda_graphs(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    # a bounded KV cache: other GPU tests of the same process may still hold memory
    llm = LLM(str(path), device="cuda", dtype="float32", progress=False, chunked_prefill_size=24, page_size=8,
              max_total_tokens=4096)
    assert llm.engine.runner.graphs is not None
    ids = torch.randint(0, 211, (61,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(path)(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
    # a decoding request (graphs) next to one scoring its prompt, and n=4 forks
    outs = llm.generate(input_ids=[ids[:9], ids], sampling_params=[{"max_new_tokens": 20, "ignore_eos": True},
                                                                   {"max_new_tokens": 3, "n": 4, "sampling_seed": 1}],
                        return_logprob=True, logprob_start_len=0)
    assert len(outs) == 5
    for out in outs[1:]:
        got = out["meta_info"]["input_token_logprobs"]
        # GPU kernels (Triton attention, other reduction orders) differ from the CPU reference by ~1e-5
        assert max(abs(a[0] - b) for a, b in zip(got[1:], want)) < 1e-3
        assert len(out["output_ids"]) == 3
    assert llm.engine.kv.num_used() == 0
    llm.shutdown()
