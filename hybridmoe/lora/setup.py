"""The LoRA manager of a model runner, from the engine options (--enable-lora, --lora-paths,
--max-loras-per-batch, --max-lora-rank, --lora-target-modules, --kt-expert-lora-path).

--kt-expert-lora-path DIR (the seed stack's expert half, e.g. convert-lora --expert-output-dir):
its tensors join the one adapter of --lora-paths (whose dir holds the non-expert half), each half
keeping its own scaling; without --lora-paths it is an adapter of its own, named by its dir.
With several --lora-paths it is an error (which adapter it belongs to would be a guess): put the
expert half into that adapter's directory instead.

Legend: S slots, E experts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hybridmoe.lora import targets
from hybridmoe.lora.adapter import LoRAAdapter, LoRAAdapterError, check_name, read_adapter
from hybridmoe.lora.cpu_bridge import CPUExpertLoRA, slot_dtype
from hybridmoe.lora.experts import ExpertLoRASlots
from hybridmoe.lora.manager import LoRAManager

log = logging.getLogger(__name__)

DEFAULT_MAX_RANK = 64  # --enable-lora without adapters or --max-lora-rank


def slot_flag(args) -> str:
    """The flag to name when the slot buffers are too large: of --max-lora-rank and --max-loras-per-batch (both
    scale every buffer), the one furthest above its default."""
    from hybridmoe.config import EngineArgs

    if args.max_lora_rank is not None and \
            args.max_lora_rank / DEFAULT_MAX_RANK >= args.max_loras_per_batch / EngineArgs.max_loras_per_batch:
        return f"--max-lora-rank {args.max_lora_rank}"
    return f"--max-loras-per-batch {args.max_loras_per_batch}"


def _check_room(args, need: int, what: str, device: torch.device) -> None:
    """The slot buffers against the memory free now, before they are allocated: where the startup check
    (sizing.check_preload_bounds) did not run (or the load took the room), a huge --max-lora-rank was the
    allocator's RuntimeError with a byte count."""
    from hybridmoe.moe.memory_plan import host_available_bytes

    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], "GPU memory"
    elif device.type == "cpu":
        free, where = host_available_bytes(), "host memory"
    else:  # (meta: nothing is allocated)
        return
    if free is not None and need > free:
        raise LoRAAdapterError(f"{slot_flag(args)}: the LoRA slot buffers ({what}) need {need / 2**30:.1f} GiB of "
                               f"{where}, {free / 2**30:.1f} GiB are free")


def lora_enabled(args) -> bool:
    return bool(args.enable_lora or args.lora_paths or args.kt_expert_lora_path)


def parse_lora_paths(values: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` or a bare `path` (named by its directory) -> (name, path), names unique."""
    out: list[tuple[str, str]] = []
    for v in values or []:
        name, sep, path = str(v).partition("=")
        if not sep:
            name, path = Path(v.rstrip("/")).name, v
        if not name or not path:
            raise LoRAAdapterError(f"--lora-paths {v!r}: expected name=path or a path")
        check_name(name, "--lora-paths: ")
        if any(n == name for n, _ in out):
            raise LoRAAdapterError(f"--lora-paths: the name {name!r} is given twice")
        out.append((name, path))
    return out


def initial_adapters(args) -> list[LoRAAdapter]:
    rank = args.max_lora_rank  # (a rank above it is refused before the adapter's tensors are read)
    adapters = [read_adapter(p, n, rank) for n, p in parse_lora_paths(args.lora_paths)]
    if args.kt_expert_lora_path:
        expert = read_adapter(args.kt_expert_lora_path, max_rank=rank)
        if len(adapters) > 1:
            raise LoRAAdapterError("--kt-expert-lora-path with several --lora-paths: which adapter it belongs to is "
                                   "ambiguous; put the expert half into that adapter's directory (convert-lora "
                                   "without --expert-output-dir)")
        if adapters:
            adapters[0].merge(expert)
        else:
            adapters = [expert]
    return adapters


def _unwrap(experts):
    return getattr(experts, "inner", experts)  # RecordingExperts


def _gpu_side(mgr: LoRAManager, backend, rows: torch.Tensor, layer: int, hidden: int, inter: int):
    """Expert LoRA slots of a GPU-side backend (torch, or the fused Triton kernels' delta hook)."""
    from hybridmoe.moe.torch_experts import TorchExperts
    from hybridmoe.moe.triton_experts import TritonExperts

    b = backend
    if not isinstance(b, (TorchExperts, TritonExperts)):
        raise LoRAAdapterError(f"layer {layer}: expert LoRA is not supported by the {b.name!r} experts backend")
    w = b.w.gate_up if isinstance(b, TorchExperts) else b.gate_up
    if w.dtype == torch.float8_e4m3fn:  # fp8 experts: the adapter in the activation dtype
        w = torch.empty(0, dtype=torch.bfloat16, device=w.device)
    b.lora = ExpertLoRASlots(rows, mgr.num_slots, mgr.max_rank, hidden, inter, mgr.batch, w.dtype, w.device)
    return b.lora


def attach_experts(mgr: LoRAManager, model) -> None:
    """Expert LoRA slots for every MoE layer: the GPU-side share next to its weights, the CPU share
    in host memory through the CPU engine's native LoRA kernels (cpu_bridge)."""
    from hybridmoe.moe.cpu_experts import CPUExperts
    from hybridmoe.moe.hybrid import HybridExperts

    hidden = model.config.hidden_size
    for block in model.moe_blocks():
        layer, backend, inter = block.layer_idx, _unwrap(block.experts), block.intermediate
        parts: list = []
        if isinstance(backend, HybridExperts):
            if backend.full_cpu_layer:  # swaps would move experts between the two sides' slot rows
                raise LoRAAdapterError("expert LoRA with --kt-enable-dynamic-expert-update is not supported")
            if backend.runtime.layerwise is not None and backend.cpu is not None:
                # the streamed experts have no adapter rows on the GPU: forwards with expert-adapter
                # tokens keep the CPU/GPU split (the CPU engine applies the CPU share); others stream
                backend.runtime.layerwise_veto = lambda b=mgr.batch: b.expert_tokens
            mask = backend.mask
            if backend.gpu is not None:
                parts.append(_gpu_side(mgr, backend.gpu, mask.nonzero().flatten(), layer, hidden, inter))
            if backend.cpu is not None:
                backend.cpu_lora = CPUExpertLoRA(backend.cpu.layer, layer, (~mask).nonzero().flatten(), mgr.num_slots,
                                                 mgr.max_rank, mgr.batch, slot_dtype(mgr.dtype))
                parts.append(backend.cpu_lora)
        elif isinstance(backend, CPUExperts):
            backend.lora = CPUExpertLoRA(backend.layer, layer, torch.arange(block.num_experts), mgr.num_slots,
                                         mgr.max_rank, mgr.batch, slot_dtype(mgr.dtype))
            parts.append(backend.lora)
        else:
            parts.append(_gpu_side(mgr, backend, torch.arange(block.num_experts), layer, hidden, inter))
        mgr.expert_slots[layer] = parts


def build_manager(args, model, device: torch.device, dtype: torch.dtype, graph_capacity: int) -> LoRAManager | None:
    """The runner's LoRA manager (None when LoRA is off), the startup adapters registered."""
    if not lora_enabled(args):
        return None
    adapters = initial_adapters(args)
    ranks = [a.max_rank for a in adapters]
    max_rank = args.max_lora_rank or max(ranks, default=DEFAULT_MAX_RANK)
    for a in adapters:
        if a.max_rank > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {a.name!r} ({a.path}): rank {a.max_rank} exceeds --max-lora-rank "
                                   f"{max_rank}")
    if args.lora_target_modules or not adapters:
        targets.check_target_names(model, args.lora_target_modules)  # (lora/plan.py checks it before the load)
        paths = targets.default_targets(model, args.lora_target_modules)
    else:
        paths = []
        for a in adapters:
            for layer, module in a.linears:
                hit = targets.resolve(model, layer, module)
                if hit is None:
                    raise LoRAAdapterError(f"{a.path}/adapter_model.safetensors: model.layers.{layer}.{module}: "
                                           f"unknown target module {module!r} for this model")
                if hit[0] not in paths:
                    paths.append(hit[0])
    _check_room(args, targets.slot_bytes(model, paths, args.max_loras_per_batch, max_rank, dtype.itemsize),
                f"{args.max_loras_per_batch} slots of rank {max_rank} on {len(paths)} linears", device)
    if device.type != "cuda" or args.disable_cuda_graph:
        # the graph index buffer is read by CUDA-graph replays only: none here (sized by --cuda-graph-max-bs and
        # --max-running-requests, it was gigabytes on the CPU when both were huge)
        graph_capacity = 0
    mgr = LoRAManager(model, device, dtype, args.max_loras_per_batch, max_rank, paths, graph_capacity,
                      max_loaded=args.max_loaded_loras)
    if any(a.has_experts for a in adapters):
        attach_experts(mgr, model)
    for a in adapters:
        mgr.register(a)
    dev, host = mgr.nbytes()
    log.info("LoRA: %d slots of rank %d on %d linears%s: %.1f MB on %s, %.1f MB host", mgr.num_slots, max_rank,
             len(paths), f" and the experts of {len(mgr.expert_slots)} layers" if mgr.expert_slots else "",
             dev / 1e6, device.type, host / 1e6)
    return mgr


def note_memory(plan, mgr: LoRAManager | None) -> None:
    """The slot buffers as lines of the startup memory plan (moe/memory_plan.py), logged."""
    if plan is None or mgr is None:
        return
    from hybridmoe.lora.adapter import GPU_LINE, HOST_LINE

    dev, host = mgr.nbytes()  # the real bytes replace the startup estimate (lora/plan.py)
    plan.gpu[GPU_LINE] = dev
    if host:
        plan.host[HOST_LINE] = host
    log.info(plan.lines()[0].replace("GPU memory plan", "GPU memory plan with the LoRA slots"))
