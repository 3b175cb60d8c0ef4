"""Sizing a hybrid model for a machine: the `--kt-method` to use (and why), CPU threads and
sub-pools, and the largest `--kt-num-gpu-experts` whose startup memory plan (moe/memory_plan.py)
fits the GPU for a context length and KV budget. Used by `hybridmoe check --model` and by
`serve --kt-num-gpu-experts auto`.

Legend: L MoE layers, E experts per layer, N GPU experts per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("hybridmoe.sizing")

GiB = 1 << 30
DEFAULT_MEM_FRACTION = 0.85


def recommend_method(isa: dict[str, bool], hf_config: Any = None) -> tuple[str, str]:
    """(--kt-method, why) for the CPU's instruction sets (check.cpu_info()["isa"]) and the checkpoint."""
    from hybridmoe.config import checkpoint_quant_method

    if hf_config is not None and checkpoint_quant_method(hf_config) == "fp8":
        return "FP8", "the checkpoint is block-scaled FP8: the CPU experts compute its own FP8 weights, no conversion"
    if isa.get("AMX int8"):
        return "AMXINT8", "AMX int8 tiles present: int8 experts on the AMX path"
    if isa.get("AVX-512 VNNI"):
        return "AMXINT8", "no AMX, AVX-512 VNNI present: int8 experts on the AVX-512 VNNI path (the name is kept)"
    if isa.get("AVX2"):
        return "AMXINT8", ("AVX2 only (no AMX, no AVX-512 VNNI): int8 experts on the AVX2 path; AMXINT4 halves the "
                           "bytes read per token at some accuracy cost")
    return "BF16", "no AVX2: the CPU expert kernels cannot run here; BF16 through the torch fallback"


@dataclass
class GpuSizing:
    """The largest GPU share that fits, with its plan."""

    num_gpu_experts: int
    num_experts: int
    gpu_budget: int | None  # bytes (None: no GPU)
    plan_gib: float = 0.0
    lines: list[str] = field(default_factory=list)  # the plan and the reason


def size_gpu_experts(hf_config: Any, spec: Any, gpu_total: int | None, *, mem_fraction: float | None = None,
                     context_len: int | None = None, kv_tokens: int | None = None, kt_method: str = "AMXINT8",
                     max_running_requests: int = 256, dtype_bytes: int = 2, prefill_tokens: int = 8192) -> GpuSizing:
    """The largest N (GPU experts per MoE layer, uniform placement) whose GPU plan fits
    `mem_fraction` of `gpu_total` bytes with a KV cache of `kv_tokens` tokens (default: one
    `context_len` context) and a prefill chunk of `prefill_tokens`. No GPU (gpu_total None): 0."""
    from hybridmoe.moe.memory_plan import plan_memory
    from hybridmoe.moe.placement import place_experts

    n_exp = spec.num_experts
    if gpu_total is None:
        return GpuSizing(0, n_exp, None, lines=["no CUDA GPU: every routed expert on the CPU (--kt-num-gpu-experts 0)"])
    frac = mem_fraction or DEFAULT_MEM_FRACTION
    budget = int(gpu_total * frac)
    ctx = context_len or hf_config.max_position_embeddings
    tokens = kv_tokens or ctx
    layers = list(spec.moe_layers)

    def plan(n: int):
        masks = place_experts("uniform", layers, n_exp, n)
        return plan_memory(hf_config, spec, masks, dtype_bytes, kt_method, tokens, max_running_requests,
                           prefill_tokens=min(prefill_tokens, ctx))

    def fits(n: int) -> bool:
        return sum(plan(n).gpu.values()) <= budget

    if not fits(0):
        need = sum(plan(0).gpu.values()) / GiB
        return GpuSizing(0, n_exp, budget, need, [f"even with no GPU experts the plan needs {need:.1f} GiB, more than "
                                                   f"the {budget / GiB:.1f} GiB budget: lower --context-length or the "
                                                   "KV budget (--max-total-tokens), or raise --mem-fraction-static"])
    lo, hi = 0, n_exp  # fits(lo) holds; find the largest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    best = plan(lo)
    total = sum(best.gpu.values()) / GiB
    lines = best.lines() + [f"{lo} of {n_exp} experts per MoE layer fit on the GPU: {total:.1f} of {budget / GiB:.1f} "
                            f"GiB ({frac:.2f} of {gpu_total / GiB:.1f} GiB) with a KV cache of {tokens} tokens"]
    return GpuSizing(lo, n_exp, budget, total, lines)


def gpu_total_bytes(device: int = 0) -> int | None:
    """Memory of CUDA device `device` (None without CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(device).total_memory)
    except Exception:  # noqa: BLE001  (no usable torch CUDA: no GPU)
        return None


def resolve_auto_gpu_experts(args: Any) -> int:
    """`--kt-num-gpu-experts auto`: the count that fits this machine's GPU, logged with its plan."""
    from hybridmoe.model_check import load_checked_config

    config, spec = load_checked_config(args.model_path, args.trust_remote_code)
    gpu = None if args.device == "cpu" else gpu_total_bytes()
    dtype_bytes = 4 if args.dtype in ("float32", "float") else 2
    s = size_gpu_experts(config, spec, gpu, mem_fraction=args.mem_fraction_static, context_len=args.context_length,
                         kv_tokens=args.max_total_tokens, kt_method=args.kt_method,
                         max_running_requests=args.max_running_requests, dtype_bytes=dtype_bytes,
                         prefill_tokens=min(args.chunked_prefill_size if args.chunked_prefill_size > 0
                                            else args.max_prefill_tokens, args.max_prefill_tokens))
    for line in s.lines:
        log.info("--kt-num-gpu-experts auto: %s", line)
    log.info("--kt-num-gpu-experts auto: using %d", s.num_gpu_experts)
    return s.num_gpu_experts
