"""The expert LoRA slot buffers in the startup memory plan, before the model is loaded: from the
flags (--max-loras-per-batch, --max-lora-rank) and the startup adapters' safetensors headers alone
(no tensor is read). The plan's fit check then sees them (host memory for the CPU share, the GPU
for the GPU share); after loading, lora/setup.py note_memory replaces the lines with the bytes the
slots really hold (and adds the wrapped linears' slots).

Per MoE layer with E_g GPU-side and E_c CPU experts, S slots of max rank R:
    GPU: S * E_g * 3 R (H + I) model-dtype elements (lora/experts.py ExpertLoRASlots)
    host: S * E_c * 3 R (Hp + Ip) slot-dtype elements (cpu/lora_slots.py; Hp, Ip the CPU layout's
          padded sizes; bf16, fp32 for an fp32 model)
"""

from __future__ import annotations

from hybridmoe.lora.adapter import GPU_LINE, HOST_LINE, LoRAAdapterError, check_adapter


def _adapter_dirs(args) -> list[str]:
    from hybridmoe.lora.setup import parse_lora_paths

    dirs = [p for _, p in parse_lora_paths(args.lora_paths)]
    return dirs + ([args.kt_expert_lora_path] if args.kt_expert_lora_path else [])


def header_info(path: str) -> tuple[bool, int]:
    """(has expert weights, largest rank) of an adapter directory from its config and header (adapter.py's
    checks, no tensor data); (False, 0) when they refuse it (read_adapter reports why when the server loads
    it). Never raises: a hostile config here was a traceback (a list for the JSON object, r of 1e400)."""
    try:
        checked = check_adapter(path)
    except (LoRAAdapterError, OSError):
        return False, 0
    return checked.has_experts, max(checked.config.r, checked.max_rank)


def expert_slot_bytes(args, hidden: int, inter: int, masks: dict, method: str, group_size: int,
                      dtype_bytes: int) -> tuple[int, int]:
    """(GPU bytes, host bytes) of the expert slots the startup adapters need (0, 0 without expert
    adapters). masks: layer -> [E] bool, True = on the GPU side."""
    from hybridmoe.cpu.quant import pad_sizes
    from hybridmoe.lora.setup import DEFAULT_MAX_RANK, lora_enabled

    if not lora_enabled(args):
        return 0, 0
    infos = [header_info(p) for p in _adapter_dirs(args)]
    if not any(e for e, _ in infos):
        return 0, 0
    rank = args.max_lora_rank or max((r for _, r in infos), default=DEFAULT_MAX_RANK) or DEFAULT_MAX_RANK
    slots = args.max_loras_per_batch
    if method.upper() == "LLAMAFILE":  # GGUF layers: rows in whole 16-lane blocks
        hp, ip = -(-hidden // 16) * 16, -(-inter // 16) * 16
    else:
        hp, ip = pad_sizes(hidden, inter, method, group_size)
    n_gpu = sum(int(m.sum()) for m in masks.values())
    n_cpu = sum(int((~m).sum()) for m in masks.values())
    host_elem = 4 if dtype_bytes == 4 else 2  # lora/cpu_bridge.py slot_dtype
    gpu = slots * n_gpu * 3 * rank * (hidden + inter) * dtype_bytes
    host = slots * n_cpu * 3 * rank * (hp + ip) * host_elem
    return gpu, host


def add_to_plan(plan, args, hidden: int, inter: int, masks: dict, method: str, group_size: int,
                dtype_bytes: int) -> None:
    """The estimate as lines of the startup memory plan (moe/memory_plan.py MemoryPlan)."""
    gpu, host = expert_slot_bytes(args, hidden, inter, masks, method, group_size, dtype_bytes)
    if gpu:
        plan.gpu[GPU_LINE] = gpu
    if host:
        plan.host[HOST_LINE] = host
