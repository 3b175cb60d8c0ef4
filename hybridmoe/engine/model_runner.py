"""Batch -> tensors -> logits: owns the model, the KV cache tensors, the attention backend and the
decode CUDA graphs.

Legend: T new tokens, B sequences, P pages per sequence in the block table, V vocabulary,
L layers, N pages, S page size, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext

import torch

from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.engine.cuda_graph import DecodeGraphs
from hybridmoe.engine.scheduler import ScheduledBatch
from hybridmoe.layers.attention.base import AttentionMetadata, get_attention_backend
from hybridmoe.layers.attention.layer import ForwardContext
from hybridmoe.models.registry import arch_spec
from hybridmoe.moe import hybrid as hybrid_mod
from hybridmoe.moe.experts import ExpertWeights, MoEExperts, create_experts
from hybridmoe.moe.hybrid import HybridPlan
from hybridmoe.moe.memory_plan import MemoryPlan, check_fits, host_available_bytes, plan_memory
from hybridmoe.moe.placement import ExpertDistributionRecorder
from hybridmoe.weights.loader import load_model

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
           "float32": torch.float32, "float": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA GPU is visible to PyTorch; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in bf16 are slow without AMX and lose parity
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = _DTYPES.get(cfg_dtype)
    return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class ModelRunner:
    """Runs forward passes for scheduled batches."""

    def __init__(self, args: EngineArgs, hf_config, progress: bool = True) -> None:
        self.args = args
        self.config = hf_config
        self.device = resolve_device(args.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # torch's OpenMP workers busy-wait: leave a core to the server loop and the OS, or one
            # other busy process slows every step tenfold.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        self.dtype = resolve_dtype(args.dtype, hf_config, self.device)
        self.page_size = args.page_size
        self.moe_options: dict = {}
        self.hybrid = HybridPlan.from_args(args, hf_config, self.device)  # None: no GPU/CPU split
        if self.hybrid is not None:
            self.moe_backend, self.moe_options = "hybrid", {"hybrid": self.hybrid}
        else:
            self.moe_backend = self._choose_moe_backend(args)
        attn = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(attn)
        model_max = getattr(hf_config, "max_position_embeddings", 4096)
        self.context_len = args.context_length or model_max
        self.memory_plan: MemoryPlan | None = None
        if self.hybrid is not None:
            self._check_memory_plan()  # before any weight is read
        self.model = load_model(
            args.model_path, hf_config, self.dtype, self.device, self._make_experts,
            max_position=max(self.context_len, model_max), progress=progress, load_format=args.load_format,
            # CPU experts are assembled (and quantized) in host memory, never on the GPU
            expert_device=(lambda _layer: torch.device("cpu")) if self.moe_backend in ("cpu", "hybrid") else None,
            # pre-converted CPU experts with no GPU share: nothing to read from the checkpoint
            read_experts=not (args.kt_weight_path is not None and self.hybrid is None),
        )
        self._alloc_kv_cache()
        if self.memory_plan is not None:  # the KV cache as allocated (the plan had its minimum)
            kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv_caches)
            self.memory_plan.gpu.pop("KV cache (minimum)", None)
            self.memory_plan.gpu["KV cache"] = kv
            log.info(self.memory_plan.lines()[0].replace("GPU memory plan", "GPU memory plan, KV cache as allocated"))
        self.vocab_size = hf_config.vocab_size
        self.recorder: ExpertDistributionRecorder | None = None
        if args.record_expert_distribution:
            self.recorder = ExpertDistributionRecorder(args.record_expert_distribution, self.model.spec.num_experts)
            for block in self.model.moe_blocks():
                block.recorder = self.recorder
        self.graphs: DecodeGraphs | None = None
        use_graphs = not args.disable_cuda_graph and self.attn_backend.supports_cuda_graph()
        if self.hybrid is not None and self.device.type == "cuda" and use_graphs and not hybrid_mod.USE_STREAM_HOST_FUNCTIONS:
            log.warning("CUDA graphs are off: hybrid CPU experts are not yet enqueued as stream host functions")
            use_graphs = False
        if self.moe_backend == "cpu" and self.device.type == "cuda" and use_graphs:
            log.warning("CUDA graphs are off: every expert on the CPU without a GPU/CPU split; pass "
                        "--kt-num-gpu-experts 0 (or more) to drive the CPU from the CUDA stream with graphs")
            use_graphs = False
        if self.device.type == "cuda" and use_graphs:
            self.graphs = DecodeGraphs(self, min(args.cuda_graph_max_bs, args.max_running_requests))
            self.graphs.capture()

    # ---- setup ----
    def _choose_moe_backend(self, args: EngineArgs) -> str:
        """The experts backend when there is no GPU/CPU split (HybridPlan.from_args gave None)."""
        if args.kt_weight_path is not None:
            return "cpu"  # experts pre-converted for the CPU engine (`hybridmoe convert`): all of them there
        if args.kt_num_gpu_experts is not None or args.kt_gpu_experts_ratio is not None:
            return "cpu"  # the split came to 0 GPU experts: every routed expert on the CPU engine
        return args.moe_backend or ("triton" if self.device.type == "cuda" else "torch")

    def _make_experts(self, weights: ExpertWeights, layer_idx: int) -> MoEExperts:
        options = {k: v for k, v in vars(self.args).items() if k.startswith("kt_")}
        options["device"] = self.device
        if self.args.load_format == "dummy" and self.device.type == "cuda":
            options["pack_device"] = self.device  # random benchmark weights: quantize on the GPU (fast)
        options.update(self.moe_options)  # backend-specific (the hybrid plan)
        if self.args.kt_weight_path is not None:  # packed by `hybridmoe convert`: read and verified, not quantized
            from hybridmoe.weights.cpu_format import open_cpu_weights

            if getattr(self, "_kt_weights", None) is None:  # checked against --model and --kt-method once
                self._kt_weights = open_cpu_weights(self.args.kt_weight_path, self.config, self.args.model_path,
                                                    self.args.kt_method)
            cpu_ids = None if self.hybrid is None or self.hybrid.dynamic_update else (
                ~self.hybrid.masks[layer_idx]).nonzero().flatten()
            # only the CPU-resident ones (all of them with dynamic expert update)
            options["packed"] = self._kt_weights.load_layer(layer_idx, experts=cpu_ids)
        return create_experts(self.moe_backend, weights, layer_idx, options)

    def _check_memory_plan(self) -> None:
        """Print where the memory goes before loading; refuse a plan that cannot fit."""
        assert self.hybrid is not None
        spec = arch_spec(self.config)
        elt = torch.finfo(self.dtype).bits // 8
        plan = plan_memory(self.config, spec, self.hybrid.masks, elt, self.args.kt_method, self.context_len,
                           self.args.max_running_requests, prefill_threshold=self.hybrid.prefill_threshold,
                           dynamic_update=self.hybrid.dynamic_update)
        for line in plan.lines():
            log.info(line)
        self.memory_plan = plan
        gpu_budget = None
        if self.device.type == "cuda":
            gpu_budget = int(torch.cuda.get_device_properties(self.device).total_memory
                             * (self.args.mem_fraction_static or 0.85))
        n_gpu = max(int(m.sum()) for m in self.hybrid.masks.values())
        reason = check_fits(plan, gpu_budget, host_available_bytes(), 3 * self.config.hidden_size
                            * spec.moe_intermediate * elt, len(spec.moe_layers), n_gpu)
        if reason:
            raise ConfigError(reason)

    def _alloc_kv_cache(self) -> None:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        hkv, layers = cfg.num_key_value_heads, cfg.num_hidden_layers
        bytes_per_token = 2 * layers * hkv * head_dim * torch.finfo(self.dtype).bits // 8
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = self.args.mem_fraction_static or 0.85
            # Leave (1 - frac) of the card for activations, graphs and other processes.
            budget = free - (1 - frac) * total
            tokens = int(max(budget, 0) // bytes_per_token)
        else:
            tokens = max(4 * self.context_len, 32768)
            tokens = min(tokens, 1 << 20)
        if tokens < 2 * self.page_size:
            raise RuntimeError(
                f"no memory left for the KV cache ({tokens} tokens fit after loading the weights); "
                "lower the model size, raise --mem-fraction-static, or set --max-total-tokens")
        num_pages = -(-tokens // self.page_size) + 1  # +1: page 0 is the scratch page
        shape = (num_pages, self.page_size, hkv, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(layers)]
        self.num_pages = num_pages
        self.context_len = min(self.context_len, (num_pages - 1) * self.page_size)
        self.max_pages_per_seq = -(-self.context_len // self.page_size)
        log.info("KV cache: %d pages x %d tokens (%.2f GB, %d tokens); context length %d", num_pages,
                 self.page_size, num_pages * self.page_size * bytes_per_token / 1e9,
                 (num_pages - 1) * self.page_size, self.context_len)

    # ---- one step ----
    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Host lists -> device tensors: input ids [T], positions [T], metadata, logits rows [B']."""
        s = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        q_lens: list[int] = []
        sample_rows: list[int] = []
        live = [(r, n, smp) for r, n, smp in zip(batch.reqs, batch.num_tokens, batch.sample) if n > 0]
        width = max(len(r.pages) for r, _, _ in live)
        table = [r.pages + [0] * (width - len(r.pages)) for r, _, _ in live]
        for r, n, smp in live:
            start = r.num_computed
            all_ids = r.all_ids
            ids.extend(all_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(r.pages[j // s] * s + j % s for j in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            q_lens.append(n)
            if smp:
                sample_rows.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            is_decode=all(n == 1 for n in q_lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_table=torch.tensor(table, dtype=torch.int32).to(dev, non_blocking=True),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens),
        )
        return (torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True),
                meta,
                torch.tensor(sample_rows, dtype=torch.int64).to(dev, non_blocking=True))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [B', V] for the requests of the batch that sample this step, in batch order."""
        if self.graphs is not None:
            live = [(r, smp) for r, n, smp in zip(batch.reqs, batch.num_tokens, batch.sample) if n > 0]
            if all(n <= 1 for n in batch.num_tokens) and self.graphs.can_run(len(live)):  # decode
                logits = self.graphs.run([r for r, _ in live], self.page_size)  # [B, V]
                if all(smp for _, smp in live):
                    return logits
                rows = [i for i, (_, smp) in enumerate(live) if smp]
                return logits[torch.tensor(rows, device=logits.device)]
        input_ids, positions, meta, rows = self.prepare(batch)
        with self._layerwise(input_ids.shape[0]):
            hidden = self.model(input_ids, positions, self._ctx(meta))
        return self.model.compute_logits(hidden[rows])

    def check_step_errors(self) -> None:
        """After a step's results were read on the host: raise what failed out of sight in it (CPU
        expert tasks driven from the CUDA stream)."""
        if self.hybrid is not None:
            self.hybrid.check_cpu_errors()

    def _ctx(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(attn_meta=meta, kv_caches=self.kv_caches, backend=self.attn_backend)

    def _layerwise(self, num_tokens: int) -> AbstractContextManager:
        """Around an eager model forward: a layerwise GPU prefill when the batch reaches
        --kt-gpu-prefill-token-threshold (decode graphs never are)."""
        return self.hybrid.layerwise_forward(num_tokens) if self.hybrid is not None else nullcontext()

    @torch.inference_mode()
    def all_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [T, V] of every new token of the batch (scoring, tests); no graphs."""
        input_ids, positions, meta, _ = self.prepare(batch)
        with self._layerwise(input_ids.shape[0]):
            hidden = self.model(input_ids, positions, self._ctx(meta))
        return self.model.compute_logits(hidden)
