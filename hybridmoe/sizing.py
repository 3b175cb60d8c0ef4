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
    if gpu is not None:  # the plans below grow with --max-running-requests: a huge one is named, not sized
        check_hybrid_batch(args, config, spec, Machine("cuda", gpu, None, dtype_bytes), planned=True)
    s = size_gpu_experts(config, spec, gpu, mem_fraction=args.mem_fraction_static, context_len=args.context_length,
                         kv_tokens=args.max_total_tokens, kt_method=args.kt_method,
                         max_running_requests=args.max_running_requests, dtype_bytes=dtype_bytes,
                         prefill_tokens=min(args.chunked_prefill_size if args.chunked_prefill_size > 0
                                            else args.max_prefill_tokens, args.max_prefill_tokens))
    for line in s.lines:
        log.info("--kt-num-gpu-experts auto: %s", line)
    log.info("--kt-num-gpu-experts auto: using %d", s.num_gpu_experts)
    return s.num_gpu_experts


# ---- buffers sized by flags alone, checked before the model loads --------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """What the flag-sized buffers are checked against: the device the model runs on, the GPU's total
    memory (None without one in use) and the host's MemAvailable (None where /proc/meminfo is unreadable)."""

    device: str  # "cuda" or "cpu"
    gpu_bytes: int | None
    host_bytes: int | None
    dtype_bytes: int  # the model dtype (--dtype, resolved)

    @staticmethod
    def of(args: Any, hf_config: Any) -> Machine:
        import torch

        from hybridmoe.engine.model_runner import resolve_device, resolve_dtype
        from hybridmoe.moe.memory_plan import host_available_bytes

        device = resolve_device(args.device)
        gpu = gpu_total_bytes(device.index or 0) if device.type == "cuda" else None
        dtype = resolve_dtype(args.dtype, hf_config, device)
        return Machine(device.type, gpu, host_available_bytes(), torch.finfo(dtype).bits // 8)


def _over(need: int, have: int | None) -> bool:
    return have is not None and need > have


def graph_batch_flag(args: Any) -> str:
    """The flag that sets the largest decode CUDA graph batch, min(--cuda-graph-max-bs, --max-running-requests)."""
    if args.cuda_graph_max_bs <= args.max_running_requests:
        return f"--cuda-graph-max-bs {args.cuda_graph_max_bs}"
    return (f"--max-running-requests {args.max_running_requests} (the largest decode CUDA graph batch, below "
            f"--cuda-graph-max-bs {args.cuda_graph_max_bs})")


def check_graph_buffers(args: Any, hf_config: Any, m: Machine) -> None:
    """The decode CUDA graphs' static buffers (engine/cuda_graph.py DecodeGraphs, and the LoRA slot index of a
    replay), sized by the largest graph batch B = min(--cuda-graph-max-bs, --max-running-requests) when graphs
    are captured: pinned host and device ids, positions, slots and row counts ([4, B] int64), sequence lengths
    and block tables (B x pages int32), the shared logits [B, vocab] in the model dtype. Allocated (and then
    captured, B / 8 graphs) after the whole load: a huge B failed there with the allocator's byte count."""
    if m.device != "cuda" or args.disable_cuda_graph:
        return
    from hybridmoe.lora.setup import lora_enabled

    b = min(args.cuda_graph_max_bs, args.max_running_requests)
    ctx = args.context_length or hf_config.max_position_embeddings
    if args.max_total_tokens is not None:  # the runner shortens the context to what the KV cache holds
        ctx = min(ctx, args.max_total_tokens)
    pages = -(-ctx // args.page_size)
    vocab = int(hf_config.vocab_size)
    lora = 4 if lora_enabled(args) else 0  # the replay's slot index (lora/batch.py graph_index), both sides
    host = b * (4 * 8 + 4 + 4 * pages + lora)
    device = b * (4 * 8 + 4 + 4 * pages + lora + vocab * m.dtype_bytes) + 4 * (b + 1)
    what = (f"the decode CUDA graphs' buffers for batches of up to {b} rows (logits [{b}, {vocab}], block tables "
            f"[{b}, {pages}])")
    if _over(device, m.gpu_bytes):
        raise _error(f"{graph_batch_flag(args)}: {what} need {device / GiB:.1f} GiB of GPU memory, the GPU has "
                     f"{m.gpu_bytes / GiB:.1f} GiB; lower it, or pass --disable-cuda-graph")
    if _over(host, m.host_bytes):
        raise _error(f"{graph_batch_flag(args)}: {what} need {host / GiB:.1f} GiB of pinned host memory, "
                     f"{m.host_bytes / GiB:.1f} GiB are available; lower it, or pass --disable-cuda-graph")


def hybrid_plan_applies(args: Any, spec: Any, device: str) -> bool:
    """Whether the runner makes the hybrid memory plan (moe/placement.py build_placement returns a placement)."""
    from hybridmoe.moe.placement import gpu_experts_per_layer

    if args.kt_num_gpu_experts is None and args.kt_gpu_experts_ratio is None:
        return False
    n_gpu = gpu_experts_per_layer(spec.num_experts, args.kt_num_gpu_experts, args.kt_gpu_experts_ratio,
                                  len(spec.moe_layers))
    return not (n_gpu == 0 and not args.kt_max_deferred_experts_per_token
                and args.kt_gpu_prefill_token_threshold is None and device != "cuda")


def check_hybrid_batch(args: Any, hf_config: Any, spec: Any, m: Machine, planned: bool | None = None) -> None:
    """The hybrid memory plan's items sized by --max-running-requests alone (moe/memory_plan.py: the CPU tasks'
    pinned buffers, the decode activations and graphs). Past the machine they made the plan refuse with advice
    about GPU experts and --kt-method, naming no flag (--max-running-requests 2147483647: "4096 GiB of host
    memory for CPU experts"). planned: whether a plan is made (None: as the runner decides; `--kt-num-gpu-experts
    auto` sizes one before that flag has a value)."""
    from hybridmoe.moe.memory_plan import batch_activation_bytes, pinned_buffer_bytes

    if not (hybrid_plan_applies(args, spec, m.device) if planned is None else planned):
        return
    rows, hidden = args.max_running_requests, int(hf_config.hidden_size)
    pinned = pinned_buffer_bytes(rows, hidden)
    if _over(pinned, m.host_bytes):
        raise _error(f"--max-running-requests {rows}: the CPU experts' pinned input/output buffers for decode "
                     f"steps of {rows} rows need {pinned / GiB:.1f} GiB of host memory, {m.host_bytes / GiB:.1f} "
                     "GiB are available")
    act = batch_activation_bytes(rows, hidden, m.dtype_bytes)
    if m.device == "cuda" and _over(act, m.gpu_bytes):
        raise _error(f"--max-running-requests {rows}: the activations and graphs of decode steps of {rows} rows "
                     f"need {act / GiB:.1f} GiB of GPU memory (the memory plan's estimate), the GPU has "
                     f"{m.gpu_bytes / GiB:.1f} GiB")


def check_lora_buffers(args: Any, hf_config: Any, spec: Any, m: Machine) -> None:
    """Every LoRA slot buffer (lora/plan.py slot_buffers: the wrapped linears' and the experts'), allocated
    after the whole load: --max-lora-rank or --max-loras-per-batch 2147483647 asked the allocator for
    terabytes there. On a GPU the device share is checked against the GPU, the CPU experts' share against
    the host; on the CPU both against the host. Also refuses --lora-target-modules names the model lacks."""
    from hybridmoe.lora.plan import slot_buffers
    from hybridmoe.lora.setup import slot_flag

    buffers = slot_buffers(args, hf_config, spec, m.device, m.dtype_bytes)
    if buffers is None:
        return
    flag = slot_flag(args)
    if m.device == "cuda" and _over(buffers.device, m.gpu_bytes):
        raise _error(f"{flag}: the LoRA slot buffers ({buffers.describe()}) need {buffers.device / GiB:.1f} GiB "
                     f"of GPU memory, the GPU has {m.gpu_bytes / GiB:.1f} GiB")
    host = buffers.host + (buffers.device if m.device != "cuda" else 0)
    if _over(host, m.host_bytes):
        raise _error(f"{flag}: the LoRA slot buffers ({buffers.describe()}) need {host / GiB:.1f} GiB of host "
                     f"memory, {m.host_bytes / GiB:.1f} GiB are available")


def _error(msg: str) -> Exception:
    from hybridmoe.config import ConfigError

    return ConfigError(msg)


def check_preload_bounds(args: Any, hf_config: Any, spec: Any = None, machine: Machine | None = None) -> None:
    """The buffers the runner allocates after the model load whose size the flags alone set, against this
    machine, before the load (startup.prepare): the decode CUDA graphs' (--cuda-graph-max-bs,
    --max-running-requests), the hybrid plan's per-row items (--max-running-requests), the LoRA slots
    (--max-lora-rank, --max-loras-per-batch; and --lora-target-modules against the model's names).
    Raises ConfigError, one line naming the flag, the bytes and what the machine has.

    Not here, being bounded otherwise: the overlap ring of sampled ids (engine/future.py grows with the rows
    a step really samples), --max-prefill-tokens and --chunked-prefill-size (a per-step token budget: the
    plan's prefill activations are capped at the context length, nothing is allocated for it)."""
    if spec is None:
        from hybridmoe.models.registry import arch_spec

        spec = arch_spec(hf_config)
    m = machine or Machine.of(args, hf_config)
    check_graph_buffers(args, hf_config, m)
    check_hybrid_batch(args, hf_config, spec, m)
    check_lora_buffers(args, hf_config, spec, m)
