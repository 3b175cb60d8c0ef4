"""The GGUF models on CUDA against the CPU device (the H200 run). The GPU runs the non-expert layers
(and GPU-side experts) in bf16 where the CPU device runs fp32, so the bound on the prompt logits is
relative to that bf16 effect itself: the directory with the GGUF's dequantized experts, CUDA against
CPU, measured in the same test. The GGUF path may add at most as much again (2x that, at least 0.05).
Greedy tokens must agree up to the first near tie (tiny_models.assert_greedy_agrees)."""

from __future__ import annotations

import gc

import torch

from hybridmoe import LLM

from tiny_models import assert_greedy_agrees

GPU_OPTS = dict(device="cuda", progress=False, mem_fraction_static=0.2, max_total_tokens=4096)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def _cuda_logits(path, prompt: list[int], **kw) -> torch.Tensor:
    llm = LLM(str(path), **GPU_OPTS, **kw)
    try:
        return llm.prompt_logits(prompt).float().cpu()
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def check_cuda_against_cpu(gguf, same_dir, gpu: int, prompt: list[int], greedy: dict, label: str) -> None:
    bf16 = _rel(_cuda_logits(same_dir, prompt), LLM(str(same_dir), device="cpu", progress=False).prompt_logits(prompt))
    ref = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=gpu)
    llm = LLM(str(gguf), **GPU_OPTS, kt_num_gpu_experts=gpu)
    try:
        first_moe = next(iter(llm.engine.runner.model.moe_blocks())).layer_idx  # DeepSeek: dense layers first
        assert llm.engine.runner.moe.placement.gpu_experts(first_moe) == gpu
        a, b = llm.prompt_logits(prompt).float().cpu(), ref.prompt_logits(prompt).float()
        rel, bound = _rel(a, b), max(0.05, 2 * bf16)
        print(f"{label} on CUDA, {gpu} GPU experts: prompt logits rel {rel:.4f} against the CPU device "
              f"(bound {bound:.4f}; the dequantized directory's own CUDA/CPU rel {bf16:.4f})")
        assert rel <= bound
        ref_tokens = ref.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
        logits = ref.prompt_logits(prompt + ref_tokens)[len(prompt) - 1: -1].float()
        top2 = logits.topk(2, dim=-1).values
        got = llm.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
        assert_greedy_agrees(got, ref_tokens, top2[:, 0] - top2[:, 1], 2 * (a - b).abs().max().item())
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
