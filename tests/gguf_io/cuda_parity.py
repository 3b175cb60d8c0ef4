"""The GGUF models on CUDA against the CPU device (the H200 run). The GPU runs the non-expert layers
(and GPU-side experts) in bf16 where the CPU device runs fp32, so the bound on the prompt logits is
relative to that bf16 effect itself: the directory with the GGUF's dequantized experts, CUDA against
CPU, measured in the same test. The GGUF path may add at most as much again (2x that, at least 0.05).
Greedy tokens must agree up to the first near tie (tiny_models.assert_greedy_agrees).

Routing replay: the CPU kernels round activations to int8 per token (Q8_K) and the GPU runs bf16, so a
token whose top-k scores nearly tie can pick another expert on one side, and on these tiny random
models that is common (on the H200: 4-7 of 29 prompt tokens of the tiny Qwen3 GGUF; the tiny
DeepSeek-V3 GGUF flipped one expert of one token, which alone moved the relative difference from ~0.02
to 0.10; the CPU device in bf16 against fp32 flips the same way). A flip makes it another model, not a
wrong kernel, so the reference replays the CUDA run's routing (routing_recorded / routing_replayed: the
same experts with the same weights, so that deferral, which defers each token's lowest-weight CPU
experts, also picks the same ones; with the reference's own weights of those experts a tiny Qwen3
GGUF with deferral 1 still differed by 0.09 in bf16 against fp32 on the CPU device, 0.05 without
deferral) and the bound is on the expert and attention numbers alone: the router's own parity is
tests/test_deepseek.py's and tests/test_parity.py's."""

from __future__ import annotations

import contextlib
import gc

import torch

from hybridmoe import LLM
from hybridmoe.moe import layer as moe_layer

from tiny_models import assert_greedy_agrees

GPU_OPTS = dict(device="cuda", progress=False, mem_fraction_static=0.2, max_total_tokens=4096)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


@contextlib.contextmanager
def routing_recorded(calls: list[tuple[torch.Tensor, torch.Tensor]]):
    """Every routing decision made meanwhile ([T, K] weights and expert ids, on the CPU) appended to `calls`."""
    real = moe_layer.route

    def recording(logits, cfg, bias=None):
        weights, ids = real(logits, cfg, bias)
        calls.append((weights.cpu(), ids.cpu()))
        return weights, ids

    moe_layer.route = recording
    try:
        yield calls
    finally:
        moe_layer.route = real


@contextlib.contextmanager
def routing_replayed(calls: list[tuple[torch.Tensor, torch.Tensor]]):
    """The recorded decisions replayed in order: each MoE layer takes the recorded experts and weights.
    All of them must be used, each once."""
    real = moe_layer.route
    left = list(calls)

    def replaying(logits, cfg, bias=None):
        weights, ids = real(logits, cfg, bias)
        assert left, "more routing decisions than recorded"
        w, want = left.pop(0)
        assert want.shape == ids.shape, f"recorded {tuple(want.shape)}, routing {tuple(ids.shape)}"
        return w.to(weights.device, weights.dtype), want.to(ids.device, ids.dtype)

    moe_layer.route = replaying
    try:
        yield
    finally:
        moe_layer.route = real
    assert not left, f"{len(left)} recorded routing decisions were not replayed"


def replayed_pair(run, ref: LLM, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt logits of run(prompt) (a callable: e.g. a CUDA LLM's prompt_logits), those of `ref` with
    run's expert choices replayed), both float32 on the CPU."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    with routing_recorded(calls):
        a = run(prompt).float().cpu()
    with routing_replayed(calls):
        b = ref.prompt_logits(prompt).float().cpu()
    return a, b


def bf16_effect(path, prompt: list[int], **kw) -> float:
    """Relative difference of the prompt logits of the model at `path` on CUDA (bf16) against the CPU
    device (fp32) with the CUDA run's expert choices replayed."""
    llm = LLM(str(path), **GPU_OPTS, **kw)
    try:
        a, b = replayed_pair(llm.prompt_logits, LLM(str(path), device="cpu", progress=False), prompt)
        return _rel(a, b)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def check_cuda_against_cpu(gguf, same_dir, gpu: int, prompt: list[int], greedy: dict, label: str) -> None:
    bf16 = bf16_effect(same_dir, prompt)
    ref = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=gpu)
    llm = LLM(str(gguf), **GPU_OPTS, kt_num_gpu_experts=gpu)
    try:
        first_moe = next(iter(llm.engine.runner.model.moe_blocks())).layer_idx  # DeepSeek: dense layers first
        assert llm.engine.runner.moe.placement.gpu_experts(first_moe) == gpu
        a, b = replayed_pair(llm.prompt_logits, ref, prompt)
        rel, bound = _rel(a, b), max(0.05, 2 * bf16)
        print(f"{label} on CUDA, {gpu} GPU experts: prompt logits rel {rel:.4f} against the CPU device with the "
              f"CUDA run's expert choices (bound {bound:.4f}; the dequantized directory's own CUDA/CPU rel {bf16:.4f})")
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
