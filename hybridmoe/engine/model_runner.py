"""Batch -> tensors -> logits: owns the model, the KV cache tensors, the attention backend and the
decode CUDA graphs.

Legend: T new tokens, B sequences, P pages per sequence in the block table, V vocabulary,
L layers, N pages, S page size, Hkv kv heads, D head dim; MLA: Lkv kv_lora_rank, R qk_rope_head_dim.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import torch

from hybridmoe.config import EngineArgs, ModelConfig
from hybridmoe.engine import prompt_logprobs
from hybridmoe.engine.cuda_graph import DecodeGraphs
from hybridmoe.engine.future import FutureTokens
from hybridmoe.engine.hooks import MoEHooks, NoHooks
from hybridmoe.engine.prefill_graph import PrefillGraphs
from hybridmoe.engine.scheduler import ScheduledBatch
from hybridmoe.layers.attention.base import AttentionMetadata, get_attention_backend, kv_cache_dtype
from hybridmoe.layers.attention.layer import ForwardContext
from hybridmoe.moe.experts_setup import ExpertsSetup
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

    def __init__(self, args: EngineArgs, model_cfg: ModelConfig, progress: bool = True) -> None:
        self.args = args
        self.model_cfg = model_cfg
        self.config = hf_config = model_cfg.hf
        self.cache_cfg = args.cache_config()
        self.device = resolve_device(args.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # torch's OpenMP workers busy-wait: leave a core to the server loop and the OS, or one
            # other busy process slows every step tenfold.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
        self.dtype = resolve_dtype(args.dtype, hf_config, self.device)
        self.page_size = self.cache_cfg.page_size
        self.context_len = self.cache_cfg.context_length or model_cfg.max_position
        # the MoE layers: which backend, the hybrid placement and runtime, the memory plan
        self.moe = ExpertsSetup(args, model_cfg, self.device, self.dtype, self.context_len)
        passive = os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and self.moe.backend == "cpu" and passive:
            # every expert on the CPU engine: its pool and torch's ops take turns (each MoE layer waits
            # for its experts), so torch gets every core too (2 cores: 107 -> 67-70 ms a decode step) -
            # only with OpenMP workers that sleep when idle (OMP_WAIT_POLICY=passive, read when torch
            # loads): busy-waiting ones on every core made a step 1.5-4x slower beside other busy processes
            from hybridmoe.cpu.topology import physical_cores

            torch.set_num_threads(len(physical_cores()))
        self.hooks: MoEHooks = self.moe.runtime or NoHooks()
        attn = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(attn)
        self.model = load_model(
            args.model_path, hf_config, self.dtype, self.device, self.moe.make,
            max_position=self.context_len, progress=progress,  # positions stay below the context length
            load_format=args.load_format, spec=model_cfg.spec, fp8_dequantize=args.fp8_dequantize,
            # CPU experts are assembled (and quantized) in host memory (random ones: moe.assemble_device)
            expert_device=lambda _layer: self.moe.assemble_device,
            # pre-converted CPU experts with no GPU share: nothing to read from the checkpoint
            read_experts=self.moe.reads_checkpoint_experts,
        )
        self.moe.finish()
        # CPU-only bf16 decode: the dense linears on the expert engine's pool, attention in one native call
        self.dense_linears = self.attn_decode = self.layer_decode = self.caller_pin = None
        if self.device.type == "cpu" and self.moe.backend == "cpu" and self.dtype == torch.bfloat16:
            from hybridmoe.cpu import hugepages
            from hybridmoe.cpu.attn_decode import install_attn_decode
            from hybridmoe.cpu.dense_linears import install_dense_linears
            from hybridmoe.cpu.layer_decode import install_layer_decode

            hugepages.move_params(self.model)  # the matrices every token streams, on 2 MB pages
            self.dense_linears = install_dense_linears(self.model, self.moe.options.pool,
                                                      int8=args.cpu_dense_weights == "int8")
            if self.dense_linears is not None and self.dense_linears.int8:
                log.info("--cpu-dense-weights int8: %d linears read as int8 at decode (%.2f GB beside the bf16 "
                         "weights prefill uses)", len(self.dense_linears.int8),
                         sum(w.nbytes for w in self.dense_linears.int8.values()) / 1e9)
            self.attn_decode = install_attn_decode(self.model)
            # and each layer's attention half (+ router GEMV) in one native call
            self.layer_decode = install_layer_decode(self.model, self.dense_linears, self.attn_decode)
            if self.dense_linears is not None:  # decode steps on the pool leader's CPU (cpu/caller_pin.py)
                from hybridmoe.cpu import caller_pin

                self.caller_pin = caller_pin.CallerPin(self.moe.options.pool, caller_pin.wanted())
        if args.cpu_dense_weights != "bf16" and self.dense_linears is None:
            log.warning("--cpu-dense-weights %s applies to CPU-only bf16 decode (--device cpu, every expert on "
                        "the CPU engine, --dtype bfloat16); ignored here", args.cpu_dense_weights)
        from hybridmoe.lora.setup import build_manager, note_memory

        # LoRA slot buffers (None when LoRA is off): wrapped linears and experts, before graphs are captured
        self.lora = build_manager(args, self.model, self.device, self.dtype,
                                  min(args.cuda_graph_max_bs, args.max_running_requests))
        note_memory(self.moe.memory_plan, self.lora)
        self._alloc_kv_cache()
        self.moe.note_kv_cache(sum(t.nbytes for layer in self.kv_caches for t in layer))
        self.vocab_size = model_cfg.vocab_size
        # sampled ids not read on the host yet (overlap scheduling): input ids < 0 are resolved from it
        self.future = FutureTokens(args.max_running_requests, self.device, blocking=self.blocking_sync_wanted)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        use_graphs = not args.disable_cuda_graph and self.attn_backend.supports_cuda_graph()
        if self.moe.backend == "cpu" and self.device.type == "cuda" and use_graphs:
            log.warning("CUDA graphs are off: every expert on the CPU without a GPU/CPU split; pass "
                        "--kt-num-gpu-experts 0 (or more) to drive the CPU from the CUDA stream with graphs")
            use_graphs = False
        if self.device.type == "cuda" and use_graphs:
            self.capture_graphs()
            self.prefill_graphs = self.new_prefill_graphs()
            if self.prefill_graphs is not None:
                self.prefill_graphs.capture()

    def prefill_graphs_blocker(self, capture: bool = True) -> str | None:
        """Why prompt batches cannot replay captured graphs here (None: they can); capture=False: the
        eager form of the padded batches (tests)."""
        if self.args.cuda_graph_max_prefill_tokens == 0:
            return "--cuda-graph-max-prefill-tokens 0"
        if self.moe.runtime is not None:  # CPU tasks, layerwise prefill, deferral: driven per forward
            return "experts on the CPU"
        if self.lora is not None:
            return "LoRA"
        if self.model_cfg.is_mla:  # its prefill picks a form from host lengths
            return "MLA attention"
        if capture and not self.attn_backend.supports_prefill_cuda_graph():
            return f"attention backend {self.attn_backend.name}"
        return None

    def new_prefill_graphs(self, capture: bool = True) -> PrefillGraphs | None:
        """Prefill graphs for this runner (not captured yet), or None where they cannot run (said in one line)."""
        why = self.prefill_graphs_blocker(capture)
        if why is not None:
            if self.args.cuda_graph_max_prefill_tokens:
                log.info("prefill CUDA graphs off: %s", why)
            return None
        # a step's tokens (a prompt chunk and decode rows), at most a sequence's pages: a capture gives all of them
        # to the padding sequence, whose block-table row has max_pages_per_seq entries (a KV cache smaller than the
        # flag, e.g. --max-total-tokens 144 under the default 512, read past the row and faulted on the GPU)
        max_tokens = min(self.args.cuda_graph_max_prefill_tokens, self.max_pages_per_seq * self.page_size)
        pool = self.graphs.pool if self.graphs is not None else None  # one memory pool with the decode graphs
        # sequences: as many as a decode graph holds, so that a prompt chunk joining that many decoding requests
        # replays too (empty slots cost the attention kernel a few programs that exit at once)
        max_seqs = min(self.args.cuda_graph_max_bs, self.args.max_running_requests)
        return PrefillGraphs(self.model, self.device, max_tokens, max_seqs, self.max_pages_per_seq, self.context_len,
                             self._ctx, self.future, pool, capture, self.recorder)

    @property
    def recorder(self):
        """The --record-expert-distribution recorder (None when off)."""
        return self.moe.recorder

    @property
    def hybrid(self):
        """The hybrid MoE layers' runtime (None without a GPU/CPU split)."""
        return self.moe.runtime

    def new_graphs(self, max_bs: int) -> DecodeGraphs:
        """Decode graphs for this runner's model and KV cache, not captured yet."""
        graphs = DecodeGraphs(self.model, self.device, max_bs, self.max_pages_per_seq, self.context_len, self._ctx,
                              self.hooks)
        graphs.lora = self.lora  # the per-token adapter slots: a graph input buffer
        graphs.future = self.future  # placeholder input ids are resolved from it before a replay
        graphs.recorder = self.recorder  # counts only the real rows of a replay
        return graphs

    def capture_graphs(self) -> None:
        """(Re)capture the decode CUDA graphs, and the prefill ones where they were in use (after a runtime
        setting changed: benchmarks)."""
        had_prefill = self.prefill_graphs is not None
        self.graphs = self.prefill_graphs = None
        graphs = self.new_graphs(min(self.args.cuda_graph_max_bs, self.args.max_running_requests))
        graphs.capture()
        self.graphs = graphs
        if had_prefill:
            prefill = self.new_prefill_graphs()
            if prefill is not None:
                prefill.capture()
            self.prefill_graphs = prefill

    def _alloc_kv_cache(self) -> None:
        m = self.model_cfg
        layers = m.num_layers
        kv_dtype = kv_cache_dtype(self.args.kv_cache_dtype, self.dtype)  # --kv-cache-dtype (fp8: half the bytes)
        if m.is_mla and kv_dtype != self.dtype:
            raise ValueError(f"--kv-cache-dtype {self.args.kv_cache_dtype}: not supported for MLA models (the latent "
                             "cache stays in the model dtype); leave it at auto")
        bytes_per_token = layers * m.kv_elements_per_token() * torch.finfo(kv_dtype).bits // 8
        if self.cache_cfg.max_total_tokens is not None:
            tokens = self.cache_cfg.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = self.cache_cfg.mem_fraction_static or 0.85
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
        self.kv_caches: list[tuple[torch.Tensor, ...]]
        if m.is_mla:  # one latent entry per token, shared by the heads: [N, S, Lkv + R]
            shape = (num_pages, self.page_size, m.kv_elements_per_token())
            self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=self.device),) for _ in range(layers)]
        else:  # K and V: [N, S, Hkv, D] each
            shape = (num_pages, self.page_size, m.num_kv_heads, m.head_dim)
            self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                               torch.zeros(shape, dtype=kv_dtype, device=self.device)) for _ in range(layers)]
        self.num_pages = num_pages
        self.context_len = min(self.context_len, (num_pages - 1) * self.page_size)
        self.max_pages_per_seq = -(-self.context_len // self.page_size)
        self.kv_dtype = kv_dtype
        log.info("KV cache: %d pages x %d tokens (%.2f GB, %d tokens, %s); context length %d", num_pages,
                 self.page_size, num_pages * self.page_size * bytes_per_token / 1e9,
                 (num_pages - 1) * self.page_size, str(kv_dtype).removeprefix("torch."), self.context_len)

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
            ids.extend(r.ids_between(start, start + n))
            pos.extend(range(start, start + n))
            slots.extend(r.pages[j // s] * s + j % s for j in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            q_lens.append(n)
            if smp:
                sample_rows.append(qsl[-1] - 1)
        dev = self.device
        pending = bool(ids) and min(ids) < 0  # placeholders of tokens sampled in a step still on the device
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
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        if pending:
            input_ids = self.future.resolve(input_ids, ids)
        return (input_ids,
                torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True),
                meta,
                torch.tensor(sample_rows, dtype=torch.int64).to(dev, non_blocking=True))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [B', V] for the requests of the batch that sample this step, in batch order.

        Prompt logprobs of the requests asking for them are left in `self.prompt_logprobs`
        ((req, entries) pairs, prompt_logprobs.compute) for the engine to keep once the step is good.
        """
        self.prompt_logprobs: list = []
        wanted = prompt_logprobs.wanted_rows(batch.reqs, batch.num_tokens)
        if self.graphs is not None and not wanted:
            live = [(r, smp) for r, n, smp in zip(batch.reqs, batch.num_tokens, batch.sample) if n > 0]
            if all(n <= 1 for n in batch.num_tokens) and self.graphs.can_run(len(live)):  # decode
                logits = self.graphs.run([r for r, _ in live], self.page_size)  # [B, V]
                if all(smp for _, smp in live):
                    return logits
                rows = [i for i, (_, smp) in enumerate(live) if smp]
                return logits[torch.tensor(rows).to(logits.device, non_blocking=True)]  # no stream sync
        if self.prefill_graphs is not None and not wanted and self.prefill_graphs.can_run(batch):
            return self.prefill_graphs.run(batch, self.page_size)
        input_ids, positions, meta, rows = self.prepare(batch)
        self._prepare_lora(batch)
        pin = self.caller_pin is not None and self.caller_pin.enabled and meta.is_decode and not wanted
        with self.caller_pin() if pin else nullcontext():  # CPU-only decode: on the pool leader's CPU
            with self.hooks.forward_scope(input_ids.shape[0]):  # e.g. a layerwise GPU prefill
                hidden = self.model(input_ids, positions, self._ctx(meta))
            if wanted:
                self.prompt_logprobs = prompt_logprobs.compute(hidden, wanted, self.model.compute_logits,
                                                               self.vocab_size)
            return self.model.compute_logits(hidden[rows])

    def check_step_errors(self) -> None:
        """After a step's results were read on the host: raise what failed out of sight in it (CPU
        expert tasks driven from the CUDA stream)."""
        self.hooks.check_errors()

    @property
    def blocking_sync_wanted(self) -> bool:
        """Whether a step's result should be waited for sleeping (hybrid on CUDA)."""
        return self.hooks.blocking_sync

    def _prepare_lora(self, batch: ScheduledBatch) -> None:
        """Each new token's adapter slot (the same request order as `prepare`)."""
        if self.lora is not None:
            live = [(r, n) for r, n in zip(batch.reqs, batch.num_tokens) if n > 0]
            self.lora.prepare([r for r, _ in live], [n for _, n in live])

    def _ctx(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(attn_meta=meta, kv_caches=self.kv_caches, backend=self.attn_backend)

    @torch.inference_mode()
    def all_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [T, V] of every new token of the batch (scoring, tests); no graphs."""
        input_ids, positions, meta, _ = self.prepare(batch)
        self._prepare_lora(batch)
        with self.hooks.forward_scope(input_ids.shape[0]):
            hidden = self.model(input_ids, positions, self._ctx(meta))
        return self.model.compute_logits(hidden)
