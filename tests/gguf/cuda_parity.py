"""The GGUF models on CUDA against the CPU device (the H200 run). The GPU runs the non-expert layers
(and GPU-side experts) in bf16 where the CPU device runs fp32, so the bound on the prompt logits is
relative to that bf16 effect itself: the directory with the GGUF's dequantized experts, CUDA against
CPU, measured in the same test. The GGUF path may add at most as much again (2x that, at least 0.05).
Greedy tokens must agree up to the first near tie (tiny_models.assert_greedy_agrees).

Routing flips: the CPU kernels round activations to int8 per token (Q8_K) and the GPU runs bf16, so a
token whose top-k scores are nearly tied can pick another expert on one side (seen on the H200: the
tiny DeepSeek-V3 GGUF with 3 GPU experts flipped one expert of prompt token 2 in its last MoE layer, and
that one token's logits moved the whole prompt's relative difference from ~0.02 to 0.10; the CPU device
in bf16 against fp32 showed the same flip). Such a token's logits are another model's, so the relative
difference is taken over the tokens whose expert choices agree in every MoE layer (both runs recorded),
and at most one token in eight (at least one) may flip."""

from __future__ import annotations

import gc

import torch

from hybridmoe import LLM

from tiny_models import assert_greedy_agrees

GPU_OPTS = dict(device="cuda", progress=False, mem_fraction_static=0.2, max_total_tokens=4096)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def record_selections(llm: LLM) -> dict[int, torch.Tensor]:
    """Each MoE layer's expert ids per token ([T, K] sorted, on the CPU) of the LLM's latest forward, kept
    up to date in the returned dict by wrappers around the layers' experts backends."""
    seen: dict[int, torch.Tensor] = {}
    for block in llm.engine.runner.model.moe_blocks():
        experts, layer = block.experts, block.layer_idx
        fwd, fwd_with = experts.forward, experts.forward_with

        def forward(x, ids, w, fwd=fwd, layer=layer):
            seen[layer] = ids.sort(dim=1).values.cpu()
            return fwd(x, ids, w)

        def forward_with(x, ids, w, extra, fwd_with=fwd_with, layer=layer):
            seen[layer] = ids.sort(dim=1).values.cpu()
            return fwd_with(x, ids, w, extra)

        experts.forward, experts.forward_with = forward, forward_with
    return seen


def prompt_logits_and_selections(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    seen = record_selections(llm)
    logits = llm.prompt_logits(prompt).float().cpu()
    return logits, dict(seen)


def flip_aware_rel(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> tuple[float, int]:
    """(relative difference of the logits over the tokens whose expert choices agree in every MoE layer,
    number of tokens that flipped); asserts that at most one token in eight (at least one) flipped."""
    (la, sa), (lb, sb) = a, b
    assert sa.keys() == sb.keys() and sa, "both runs must record the same MoE layers"
    flipped = torch.zeros(la.shape[0], dtype=torch.bool)
    for layer in sa:
        flipped |= (sa[layer] != sb[layer]).any(dim=1)
    n = int(flipped.sum())
    assert n <= max(1, la.shape[0] // 8), f"{n} of {la.shape[0]} prompt tokens chose other experts"
    keep = ~flipped
    return _rel(la[keep], lb[keep]), n


def _cuda_logits(path, prompt: list[int], **kw) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Prompt logits and expert choices of the model at `path` on CUDA."""
    llm = LLM(str(path), **GPU_OPTS, **kw)
    try:
        return prompt_logits_and_selections(llm, prompt)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def check_cuda_against_cpu(gguf, same_dir, gpu: int, prompt: list[int], greedy: dict, label: str) -> None:
    bf16, _ = flip_aware_rel(_cuda_logits(same_dir, prompt),
                             prompt_logits_and_selections(LLM(str(same_dir), device="cpu", progress=False), prompt))
    ref = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=gpu)
    llm = LLM(str(gguf), **GPU_OPTS, kt_num_gpu_experts=gpu)
    try:
        first_moe = next(iter(llm.engine.runner.model.moe_blocks())).layer_idx  # DeepSeek: dense layers first
        assert llm.engine.runner.moe.placement.gpu_experts(first_moe) == gpu
        got, want = prompt_logits_and_selections(llm, prompt), prompt_logits_and_selections(ref, prompt)
        a, b = got[0], want[0]
        (rel, flips), bound = flip_aware_rel(got, want), max(0.05, 2 * bf16)
        print(f"{label} on CUDA, {gpu} GPU experts: prompt logits rel {rel:.4f} against the CPU device over the "
              f"tokens that chose the same experts ({flips} flipped; bound {bound:.4f}; the dequantized "
              f"directory's own CUDA/CPU rel {bf16:.4f})")
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
