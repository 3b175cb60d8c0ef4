"""cuda_parity.py's routing replay on the CPU device (its GPU users run only on the H200): a bf16 run's
routing replayed in the fp32 reference leaves only the bf16 numbers (the bound the CUDA tests use), the
replay consumes every decision once, and a run replayed into itself changes nothing."""

from __future__ import annotations

import pytest
import torch
from cuda_parity import replayed_pair, routing_recorded, routing_replayed

from hybridmoe import LLM

PROMPT = torch.randint(0, 4000, (29,), generator=torch.Generator().manual_seed(5)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_replay_leaves_the_bf16_numbers(qwen3_gguf):
    opts = dict(device="cpu", progress=False, kt_num_gpu_experts=3, kt_max_deferred_experts_per_token=1)
    ref = LLM(str(qwen3_gguf[1]), **opts)
    run = LLM(str(qwen3_gguf[1]), dtype="bfloat16", **opts)
    a, b = replayed_pair(run.prompt_logits, ref, PROMPT)
    assert _rel(a, b) < 0.05  # measured 0.035 (without the replay: routing flips, tests/gguf_io/cuda_parity.py)
    own = ref.prompt_logits(PROMPT).float()
    same_a, same_b = replayed_pair(ref.prompt_logits, ref, PROMPT)
    assert torch.equal(same_a, own) and torch.equal(same_b, own)


def test_replay_consumes_every_decision_once(qwen3_gguf):
    llm = LLM(str(qwen3_gguf[1]), device="cpu", progress=False)
    calls = []
    with routing_recorded(calls):
        llm.prompt_logits(PROMPT)
    assert len(calls) == len(list(llm.engine.runner.model.moe_blocks()))
    with pytest.raises(AssertionError, match="not replayed"):
        with routing_replayed(calls + calls[:1]):
            llm.prompt_logits(PROMPT)
    with pytest.raises(AssertionError, match="more routing decisions"):
        with routing_replayed(calls[:-1]):
            llm.prompt_logits(PROMPT)
