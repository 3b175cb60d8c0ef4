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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridmoe.lora import targets
from hybridmoe.lora.adapter import GPU_LINE, HOST_LINE, CheckedAdapter, LoRAAdapterError, check_adapter


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


# ---- every slot buffer, before the load (sizing.check_preload_bounds) --------------------------------------------
@dataclass(frozen=True)
class SlotBuffers:
    """The LoRA slot buffers the runner allocates after the load (lora/setup.py build_manager), in bytes:
    `device` on --device (the wrapped linears' A and B, the GPU-side expert slots), `host` in host memory
    (the CPU experts' slots)."""

    slots: int  # --max-loras-per-batch
    rank: int  # --max-lora-rank, or the largest rank of the startup adapters
    linears: int  # wrapped linears
    expert_layers: int  # MoE layers with expert slots (0 without expert adapters)
    device: int
    host: int

    def describe(self) -> str:
        experts = f" and the experts of {self.expert_layers} MoE layers" if self.expert_layers else ""
        return f"{self.slots} slots of rank {self.rank} on {self.linears} linears{experts}"


def meta_model(hf_config: Any, spec: Any) -> nn.Module:
    """The model's modules on the meta device (no memory): its linears' names and shapes before the load."""
    from hybridmoe.models.base import MoECausalLM

    with torch.device("meta"):
        return MoECausalLM(hf_config, spec, int(getattr(hf_config, "max_position_embeddings", 4096)))


def _checked(path: str) -> CheckedAdapter | None:
    """The adapter's config and header, or None when they are refused: read_adapter reports why when the runner
    reads it, as before (this estimate is no place to change which error a bad adapter gets)."""
    try:
        return check_adapter(path)
    except (LoRAAdapterError, OSError):
        return None


def _target_paths(model: nn.Module, args: Any, adapters: list[CheckedAdapter]) -> list[str]:
    """The linears build_manager wraps: --lora-target-modules' (or all of them without startup adapters),
    else those the adapters name."""
    if args.lora_target_modules or not adapters:
        targets.check_target_names(model, args.lora_target_modules)
        return targets.default_targets(model, args.lora_target_modules)
    paths: list[str] = []
    for a in adapters:
        for layer, module in a.pairs:
            hit = targets.resolve(model, layer, module)  # (an expert's module, absent on meta: no linear slot)
            if hit is not None and hit[0] not in paths:
                paths.append(hit[0])
    return paths


def _gpu_side_experts(args: Any, spec: Any, device_type: str) -> int:
    """Routed experts of all MoE layers together whose LoRA slots sit on --device (ExpertsSetup's backend
    choice: the GPU share of a hybrid placement, none on the CPU engine, all of them otherwise)."""
    from hybridmoe.moe.placement import gpu_expert_counts

    cfg = args.hybrid_config()
    layers = len(spec.moe_layers)
    if cfg.split_requested:
        n_gpu = sum(gpu_expert_counts(spec.num_experts, layers, cfg.num_gpu_experts, cfg.gpu_experts_ratio))
        placed = not (n_gpu == 0 and not cfg.max_deferred_experts_per_token
                      and cfg.gpu_prefill_token_threshold is None and device_type != "cuda")
        return n_gpu if placed else 0
    return 0 if cfg.weight_path is not None else spec.num_experts * layers


def slot_buffers(args: Any, hf_config: Any, spec: Any, device_type: str, dtype_bytes: int) -> SlotBuffers | None:
    """Every LoRA slot buffer the flags and the startup adapters' headers ask for (None when LoRA is off);
    refuses --lora-target-modules names this model does not have (LoRAAdapterError naming the flag)."""
    from hybridmoe.cpu.quant import pad_sizes
    from hybridmoe.lora.setup import DEFAULT_MAX_RANK, lora_enabled

    if not lora_enabled(args):
        return None
    model = meta_model(hf_config, spec)
    adapters = [c for c in map(_checked, _adapter_dirs(args)) if c is not None]
    rank = args.max_lora_rank or max((a.max_rank for a in adapters), default=DEFAULT_MAX_RANK) or DEFAULT_MAX_RANK
    slots = args.max_loras_per_batch
    paths = _target_paths(model, args, adapters)
    device, host, layers = targets.slot_bytes(model, paths, slots, rank, dtype_bytes), 0, 0
    if any(a.has_experts for a in adapters):  # attach_experts: slots for every routed expert of every MoE layer
        cfg = args.hybrid_config()
        hidden, inter, n_exp = int(hf_config.hidden_size), spec.moe_intermediate, spec.num_experts
        n_gpu = _gpu_side_experts(args, spec, device_type)  # all MoE layers together
        layers = len(spec.moe_layers)
        hp, ip = ((-(-hidden // 16) * 16, -(-inter // 16) * 16) if cfg.method.upper() == "LLAMAFILE"
                  else pad_sizes(hidden, inter, cfg.method, cfg.group_size))
        host_elem = 4 if dtype_bytes == 4 else 2  # lora/cpu_bridge.py slot_dtype
        device += n_gpu * slots * 3 * rank * (hidden + inter) * dtype_bytes
        host += (layers * n_exp - n_gpu) * slots * 3 * rank * (hp + ip) * host_elem
    return SlotBuffers(slots, rank, len(paths), layers, device, host)
