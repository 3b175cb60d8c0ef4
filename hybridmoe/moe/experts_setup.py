"""How a model's MoE layers are built: which experts backend, the hybrid placement and runtime,
the CPU pool, converted CPU weights (--kt-weight-path), the startup memory plan and the
expert-distribution recorder. The model runner creates one `ExpertsSetup` and hands its `make`
to the loader; nothing else in the engine knows these policies.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hybridmoe.config import ConfigError, EngineArgs, ModelConfig, check_kt_method
from hybridmoe.moe.experts import ExpertWeights, MoEExperts, create_experts
from hybridmoe.moe.memory_plan import MemoryPlan, check_fits, host_available_bytes, plan_memory
from hybridmoe.moe.options import ExpertsOptions
from hybridmoe.moe.placement import HybridPlacement, build_placement
from hybridmoe.moe.recorder import ExpertDistributionRecorder, RecordingExperts

if TYPE_CHECKING:
    from hybridmoe.moe.runtime import HybridRuntime

log = logging.getLogger(__name__)


class ExpertsSetup:
    """The MoE side of one model runner (see the module docstring)."""

    def __init__(self, args: EngineArgs, model: ModelConfig, device: torch.device, dtype: torch.dtype,
                 context_len: int) -> None:
        self.args, self.model, self.device, self.dtype = args, model, device, dtype
        self.hybrid_cfg = cfg = args.hybrid_config()
        if device.type == "cpu" and cfg.cpuinfer is None:  # no GPU thread to leave a core for: every core
            from dataclasses import replace

            from hybridmoe.cpu.topology import physical_cores

            self.hybrid_cfg = cfg = replace(cfg, cpuinfer=len(physical_cores()))
        check_kt_method(cfg.method, model.hf, model.source)
        self.placement: HybridPlacement | None = build_placement(cfg, model, device, args.moe_backend)
        self.runtime: HybridRuntime | None = None
        if self.placement is not None:
            self.backend = "hybrid"
        elif cfg.weight_path is not None or cfg.split_requested:
            # experts pre-converted for the CPU engine, or a split that came to 0 GPU experts: all on the CPU
            self.backend = "cpu"
        else:
            self.backend = args.moe_backend or ("triton" if device.type == "cuda" else "torch")
        pool = None
        if self.backend in ("cpu", "hybrid"):
            from hybridmoe.moe.cpu_experts import cpu_pool_for

            pool = cpu_pool_for(cfg)
        self.options = ExpertsOptions(
            device=device, hybrid=cfg, pool=pool, dtype=dtype,
            # random benchmark weights: quantize on the GPU (fast)
            pack_device=device if args.load_format == "dummy" and device.type == "cuda" else None)
        self.memory_plan: MemoryPlan | None = None
        if self.placement is not None:
            from hybridmoe.moe.runtime import HybridRuntime

            self.runtime = HybridRuntime(self.placement, device, pool, blocking_sync=cfg.blocking_sync,
                                         stream_wait=cfg.stream_wait)
            self.options = ExpertsOptions(device=device, hybrid=cfg, pool=pool, runtime=self.runtime,
                                          pack_device=self.options.pack_device, dtype=dtype)
            self._check_memory_plan(context_len)  # before any weight is read
        # `--load-format dummy` with every expert on the CPU engine: random experts drawn directly in
        # packed form (cpu/pack.random_packed_layer), no float copy of them ever made
        self.random_packed = (self.backend == "cpu" and args.load_format == "dummy" and cfg.converted_weights is None
                              and cfg.method.upper() in ("AMXINT8", "AMXINT4", "BF16"))
        # always counting (one index_add_ per MoE layer): the expert-distribution record endpoints
        # and the share of routed-expert hits on the GPU read it; --record-expert-distribution is its file
        self.recorder = ExpertDistributionRecorder(cfg.record_expert_distribution, model.num_experts, device,
                                                   tuple(model.spec.moe_layers))
        self.kt_weights = getattr(self, "kt_weights", None)  # the GGUF, when the memory plan opened it
        self._built: dict[int, MoEExperts] = {}

    @property
    def on_host(self) -> bool:
        """Whether the loader assembles expert tensors in host memory (CPU experts, quantized there)."""
        return self.backend in ("cpu", "hybrid")

    @property
    def assemble_device(self) -> torch.device:
        """Where the loader assembles a MoE layer's stacked expert tensors: host memory for CPU experts
        (quantized there), except random benchmark weights on a GPU machine: drawn on the GPU, the
        GPU-resident experts kept there and the CPU ones packed there (options.pack_device), so no float
        copy of a layer ever sits in host memory (a DeepSeek-V3 layer is 22.5 GB in bf16)."""
        if self.on_host and not (self.args.load_format == "dummy" and self.device.type == "cuda"):
            return torch.device("cpu")
        return self.device

    @property
    def reads_checkpoint_experts(self) -> bool:
        """False when every expert comes pre-converted from --kt-weight-path."""
        if self.hybrid_cfg.method == "LLAMAFILE":  # GPU experts too come from the GGUF (make)
            return False
        return not ((self.hybrid_cfg.converted_weights is not None and self.placement is None) or self.random_packed)

    def make(self, weights: ExpertWeights | None, layer_idx: int) -> MoEExperts:
        """One MoE layer's experts backend (the loader calls this once per MoE layer)."""
        options = self.options
        if self.hybrid_cfg.method == "LLAMAFILE":  # the experts as the GGUF file stores them (mapped, not copied)
            from dataclasses import replace

            from hybridmoe.gguf.experts import layer_experts, open_for_model

            if self.kt_weights is None:
                self.kt_weights = open_for_model(self.hybrid_cfg.weight_path, self.model.hf, self.model.spec,
                                                 model_path=self.args.model_path)
            act = weights.activation if weights is not None else "silu"
            packed = layer_experts(self.kt_weights, layer_idx, self.model.spec.num_experts,
                                   int(self.model.hf.hidden_size), self.model.spec.moe_intermediate, act,
                                   model_path=self.args.model_path)
            p = self.placement
            if p is not None:  # GPU-resident experts dequantized now, the others stay blocks
                from hybridmoe.gguf.gpu_experts import gpu_expert_weights, select_experts

                mask = p.masks[layer_idx]
                weights = gpu_expert_weights(packed, mask, self.dtype)
                if not p.dynamic_update:  # (with it the CPU layer holds every expert: the whole file tensor)
                    page_align = p.prefill_threshold is not None and self.device.type == "cuda"  # page-locked
                    packed = select_experts(packed, (~mask).nonzero().flatten(), page_align=page_align)
            options = replace(options, packed=packed)
        elif self.hybrid_cfg.converted_weights is not None:  # packed by `hybridmoe convert`: read and verified
            from dataclasses import replace

            from hybridmoe.weights.cpu_format import open_cpu_weights

            if self.kt_weights is None:  # checked against --model and --kt-method once
                self.kt_weights = open_cpu_weights(self.hybrid_cfg.converted_weights, self.model.hf, self.args.model_path,
                                                    self.hybrid_cfg.method, spec=self.model.spec)
            p = self.placement
            cpu_ids = None if p is None or p.dynamic_update else (~p.masks[layer_idx]).nonzero().flatten()
            # only the CPU-resident ones (all of them with dynamic expert update)
            options = replace(options, packed=self.kt_weights.load_layer(layer_idx, experts=cpu_ids))
        elif self.random_packed:
            from dataclasses import replace

            from hybridmoe.cpu.pack import random_packed_layer

            cfg, spec = self.hybrid_cfg, self.model.spec
            options = replace(options, packed=random_packed_layer(
                spec.num_experts, self.model.hf.hidden_size, spec.moe_intermediate, cfg.method, cfg.group_size,
                cfg.int4_symmetric, seed=layer_idx, pool=options.pool))
        experts = self._built[layer_idx] = create_experts(self.backend, weights, layer_idx, options)
        if self.recorder is not None:
            return RecordingExperts(experts, self.recorder, layer_idx)
        return experts

    def finish(self) -> None:
        """Every layer is built: the runtime gets them (layerwise prefill, deferral changes)."""
        if self.runtime is not None:
            self.runtime.attach(self._built)

    def note_kv_cache(self, nbytes: int) -> None:
        """The KV cache as allocated replaces the plan's minimum; the plan's first line again."""
        if self.memory_plan is not None:
            self.memory_plan.gpu.pop("KV cache (minimum)", None)
            self.memory_plan.gpu["KV cache"] = nbytes
            log.info(self.memory_plan.lines()[0].replace("GPU memory plan", "GPU memory plan, KV cache as allocated"))

    def _check_memory_plan(self, context_len: int) -> None:
        """Print where the memory goes before loading; refuse a plan that cannot fit."""
        p, cfg, m = self.placement, self.hybrid_cfg, self.model
        assert p is not None
        elt = torch.finfo(self.dtype).bits // 8
        cpu_bytes = None
        if cfg.method == "LLAMAFILE":  # the GGUF blocks' real sizes (each layer may have its own types)
            from hybridmoe.gguf.experts import open_for_model
            from hybridmoe.gguf.gpu_experts import expert_bytes_by_layer

            self.kt_weights = getattr(self, "kt_weights", None) or open_for_model(cfg.weight_path, m.hf, m.spec,
                                                                model_path=self.args.model_path)
            cpu_bytes = expert_bytes_by_layer(self.kt_weights, m.spec.moe_layers)
        chunk = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else self.args.max_prefill_tokens
        plan = plan_memory(m.hf, m.spec, p.masks, elt, cfg.method, context_len, self.args.max_running_requests,
                           prefill_threshold=p.prefill_threshold, dynamic_update=p.dynamic_update,
                           cpu_expert_bytes=cpu_bytes,
                           prefill_tokens=min(chunk, self.args.max_prefill_tokens, context_len))
        from hybridmoe.lora.plan import add_to_plan  # expert LoRA slots, from the adapters' headers

        add_to_plan(plan, self.args, m.hf.hidden_size, m.spec.moe_intermediate, p.masks, cfg.method, cfg.group_size, elt)
        for line in plan.lines():
            log.info(line)
        self.memory_plan = plan
        gpu_budget = None
        if self.device.type == "cuda":
            gpu_budget = int(torch.cuda.get_device_properties(self.device).total_memory
                             * (self.args.mem_fraction_static or 0.85))
        n_gpu = max(int(mask.sum()) for mask in p.masks.values())
        reason = check_fits(plan, gpu_budget, host_available_bytes(),
                            plan.gpu_expert_bytes, len(m.spec.moe_layers), n_gpu)
        if reason:
            raise ConfigError(reason)
