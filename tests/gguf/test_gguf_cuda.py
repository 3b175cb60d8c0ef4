"""The GGUF path on CUDA (the H200 run): `--model FILE.gguf` alone with some experts on the GPU
(dequantized at load) and the rest on the CPU kernels, graphs on, against the same file on the CPU
device. The GPU runs the non-expert layers in bf16 where the CPU device runs fp32, so greedy tokens are
compared up to the first near tie (tiny_models.assert_greedy_agrees), as in test_gguf_model.py."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM

from tiny_models import assert_greedy_agrees

PROMPT = torch.randint(0, 4000, (29,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = {"max_new_tokens": 12, "temperature": 0}

pytestmark = pytest.mark.gpu


def _greedy(llm: LLM) -> list[int]:
    return llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


@pytest.mark.parametrize("gpu", [0, 3, 10])
def test_gguf_on_cuda_matches_the_cpu_device(qwen3_gguf, gpu):
    _, gguf, _ = qwen3_gguf
    ref = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=gpu)
    llm = LLM(str(gguf), device="cuda", progress=False, kt_num_gpu_experts=gpu)
    try:
        assert llm.engine.runner.moe.placement.gpu_experts(0) == gpu
        a, b = llm.prompt_logits(PROMPT).float().cpu(), ref.prompt_logits(PROMPT).float()
        rel = ((a - b).norm() / b.norm()).item()
        print(f"GGUF on CUDA, {gpu} GPU experts: prompt logits rel {rel:.4f} against the CPU device")
        assert rel < 0.05  # bf16 non-expert layers against fp32
        ref_tokens = _greedy(ref)
        logits = ref.prompt_logits(PROMPT + ref_tokens)[len(PROMPT) - 1: -1].float()
        top2 = logits.topk(2, dim=-1).values
        tie = 2 * (a - b).abs().max().item()
        assert_greedy_agrees(_greedy(llm), ref_tokens, top2[:, 0] - top2[:, 1], tie)
    finally:
        llm.shutdown()
