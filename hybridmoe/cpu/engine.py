"""Python face of the CPU expert engine: the thread pool and one MoE layer's packed experts.

Legend: T tokens, K top-k, E experts, H hidden.

    pool = CPUThreadPool(threads=15, settings=CPUEngineSettings())   # or default_pool()
    layer = CPUMoELayer(pack_layer(gate_up, down, "AMXINT8"), pool=pool)
    task = layer.submit(x, ids, w, out=buf, accumulate=True, skip_mask=on_gpu)   # returns at once
    ...                                                    # GPU work
    layer.sync(task)                                       # waits; raises CPUMoEError on failure
    y = layer.forward(x, ids, w)                           # submit + sync

Tasks run on the pool in submission order. A failed task (bad expert id, NaN input, ...) raises at
the sync that covers it; later tasks run normally.
"""

from __future__ import annotations

import atexit
import ctypes as C
import re
import threading

import torch

from hybridmoe import envs
from hybridmoe.cpu import native
from hybridmoe.cpu.lora_slots import CPULoRASlots, check_lora_idx
from hybridmoe.cpu.quant import ACTIVATIONS, PackedLayer, PackedMatrix, method_code
from hybridmoe.cpu.settings import CPUEngineSettings
from hybridmoe.cpu.topology import node_of, plan_threads


class CPUMoEError(RuntimeError):
    """A CPU expert task (or a native dense linear, cpu/dense.py) failed. `token`: the row of the task's
    input (the forward's token) whose own values caused it, where the native error names one (a non-finite
    routing weight, input row or expert activation); None otherwise."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        m = _TOKEN_ERROR.search(message)
        self.token: int | None = int(m.group(1) or m.group(2)) if m else None


# the native errors that name the token at fault (csrc/moe.cpp: a non-finite routing weight, input row or
# expert activation; csrc/dense_api.cpp: a non-finite input row of an int8 dense linear)
_TOKEN_ERROR = re.compile(r"(?:non-finite routing weight|holds NaN or Inf(?: \([^()]*\))?) at token (\d+)"
                          r"|row (\d+) of the input holds NaN or Inf")


# CPUThreadPool.fuse_mode's names -> the native fuse bits (csrc/moe.h: 1 the one-token weighted sum inside the
# down phase, 2 the few-row activation conversion inside the gate/up phase, 4 with 2: the down items in the gate/up
# phase, each after its expert's rows, no barrier between the two)
FUSE_MODES = {"on": 7, "off": 0, "reduce": 1, "quant": 2, "chain": 6, "nochain": 3}


class CPUThreadPool:
    """The native thread pool: `threads` pinned threads (None: physical cores - 1) in
    `threadpool_count` sub-pools (one per NUMA node), optionally only on `numa_nodes`' cores, tuned
    by `settings` (fixed for the pool's life)."""

    def __init__(self, threads: int | None = None, threadpool_count: int = 1, numa_nodes: list[int] | None = None,
                 settings: CPUEngineSettings | None = None):
        settings = CPUEngineSettings() if settings is None else settings
        if not isinstance(settings, CPUEngineSettings):
            raise TypeError(f"settings must be a CPUEngineSettings, got {type(settings).__name__}")
        cpus, nsub = plan_threads(threads, threadpool_count, numa_nodes)
        arr = (C.c_int * len(cpus))(*cpus)
        err = C.create_string_buffer(512)
        native_settings = native.PoolSettings.of(settings)
        handle = native.lib().hm_pool_create(len(cpus), arr, nsub, C.byref(native_settings), err, len(err))
        if not handle:
            raise native.CpuIsaError(err.value.decode())
        self._h = handle
        if envs.amx_inline():
            self.inline_amx = True
        self.settings = settings
        self.cpus = cpus
        self.threads = len(cpus)
        self.subpools = native.lib().hm_pool_num_sub(handle)
        self._refs: dict[int, tuple] = {}  # task id -> tensors kept alive until synced
        self._mu = threading.Lock()

    @property
    def handle(self) -> int:
        return self._h

    def close(self) -> None:
        if getattr(self, "_h", None):
            native.lib().hm_pool_destroy(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def submit(self, task: native.Task, keep: tuple) -> int:
        if not self._h:
            raise CPUMoEError("the CPU thread pool is closed")
        tid = native.lib().hm_submit(self._h, C.byref(task))
        with self._mu:
            self._refs[tid] = keep
        return tid

    def sync(self, task_id: int | None = None, max_pending: int = 0) -> None:
        """Waits for task `task_id` (or until at most `max_pending` tasks are pending); raises the first
        error of the tasks finished meanwhile."""
        if not self._h:
            raise CPUMoEError("the CPU thread pool is closed")
        err = C.create_string_buffer(1024)
        lb = native.lib()
        failed = lb.hm_sync(self._h, int(task_id or 0), int(max_pending), err, len(err))
        done = lb.hm_completed(self._h)
        with self._mu:
            for k in [k for k in self._refs if k <= done]:
                del self._refs[k]
        if failed:
            raise CPUMoEError(err.value.decode())

    def subpool_nodes(self) -> list[int]:
        """NUMA node of each sub-pool (that of its first CPU)."""
        n, s = self.threads, self.subpools
        return [node_of(self.cpus[(i * n + s - 1) // s]) for i in range(s)]

    def native_settings(self) -> CPUEngineSettings:
        """The settings the native pool was created with (read back from it)."""
        out = native.PoolSettings()
        native.lib().hm_pool_settings(self._h, C.byref(out))
        return out.to_settings()

    def pending(self) -> int:
        return native.lib().hm_pending(self._h)

    @property
    def run_inline(self) -> bool:
        """Whether synchronous calls (CPUMoELayer.forward/run, the dense linears) run on the calling
        thread in the pool leader's place when the pool is idle (default), instead of being queued
        to the leader and waited for; benchmarks switch it off to compare."""
        return bool(native.lib().hm_pool_inline(self._h, -1))

    @run_inline.setter
    def run_inline(self, on: bool) -> None:
        native.lib().hm_pool_inline(self._h, (2 if self.inline_amx else 1) if on else 0)

    @property
    def inline_amx(self) -> bool:
        """Whether run_inline covers the tasks of AMX layers too (off: they go to the pool threads; see
        hm_run_task in csrc/api.cpp). HYBRIDMOE_AMX_INLINE=1 sets it at creation (a development knob until
        tests/cpu/test_amx_caller_thread.py has passed on an AMX host)."""
        return native.lib().hm_pool_inline(self._h, -1) == 2

    @inline_amx.setter
    def inline_amx(self, on: bool) -> None:  # turns run_inline on
        native.lib().hm_pool_inline(self._h, 2 if on else 1)

    @property
    def prefetch_bytes(self) -> int:
        """The few-row kernels' software prefetch distance now (bytes; CPUEngineSettings.prefetch_bytes at
        creation). Benchmarks change it between calls to compare distances in one process."""
        return int(native.lib().hm_pool_prefetch(self._h, -1))

    @prefetch_bytes.setter
    def prefetch_bytes(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not 0 <= int(nbytes) <= 1 << 20:
            raise ValueError(f"prefetch_bytes must be in [0, {1 << 20}], got {nbytes}")
        native.lib().hm_pool_prefetch(self._h, int(nbytes))

    @property
    def dynamic_phases(self) -> bool:
        """Whether phases whose work is claimed from a counter (dense GEMVs, attention, the MoE GEMMs)
        skip threads that join after the work is all taken (default) instead of waiting for every thread;
        benchmarks switch it off to compare."""
        return bool(native.lib().hm_pool_dynamic(self._h, -1))

    @dynamic_phases.setter
    def dynamic_phases(self, on: bool) -> None:
        native.lib().hm_pool_dynamic(self._h, int(bool(on)))

    def _fuse_bit(self, bit: int, on: bool | None) -> bool:
        """Reads (on None) or sets one of the pool's fuse bits (csrc/moe.h kFuse*); returns the bit before."""
        lib = native.lib()
        was = lib.hm_pool_fuse(self._h, -1)
        if on is not None:
            lib.hm_pool_fuse(self._h, (was | bit) if on else (was & ~bit))
        return bool(was & bit)

    @property
    def fused_reduce(self) -> bool:
        """Whether a one-token MoE task does its weighted sum of the experts' outputs inside the down-projection
        phase, each output chunk by the thread that completes it (default), instead of after that phase
        (on the leader alone up to reduce_inline_rows); benchmarks switch it off to compare."""
        return self._fuse_bit(1, None)

    @fused_reduce.setter
    def fused_reduce(self, on: bool) -> None:
        self._fuse_bit(1, bool(on))

    @property
    def fused_quant(self) -> bool:
        """Whether a MoE task with at most 16 rows an expert (decode) converts each expert's activation rows
        for the down projection inside the gate/up phase, by the thread that completes the expert's last
        item (default), instead of in a phase of its own after it (on the leader alone up to 8 rows; not
        with LoRA adapters, nor for GGUF layers, which convert per 256-column block inside the phase
        anyway); benchmarks switch it off to compare."""
        return self._fuse_bit(2, None)

    @fused_quant.setter
    def fused_quant(self, on: bool) -> None:
        self._fuse_bit(2, bool(on))

    @property
    def chained_phases(self) -> bool:
        """With fused_quant's tasks: whether the down-projection items run in the gate/up phase, each once its
        expert's activation rows are converted (default), instead of in a phase after a barrier; benchmarks
        switch it off to compare."""
        return self._fuse_bit(4, None)

    @chained_phases.setter
    def chained_phases(self, on: bool) -> None:
        self._fuse_bit(4, bool(on))

    @property
    def fuse_mode(self) -> str:
        """The three fuse settings as one name of FUSE_MODES (benchmarks' --fuse): on (all, the default), off
        (none), reduce (fused_reduce only), quant (fused_quant only), chain (fused_quant and chained_phases),
        nochain (fused_reduce and fused_quant); "bits N" for another mix."""
        bits = native.lib().hm_pool_fuse(self._h, -1)
        return next((k for k, v in FUSE_MODES.items() if v == bits), f"bits {bits}")

    @fuse_mode.setter
    def fuse_mode(self, mode: str) -> None:
        if mode not in FUSE_MODES:
            raise ValueError(f"fuse mode {mode!r}: one of {', '.join(FUSE_MODES)}")
        native.lib().hm_pool_fuse(self._h, FUSE_MODES[mode])

    @property
    def block_prefetch(self) -> int:
        """The GGUF decode kernels' next-block prefetch: 0 none; 1 (default) / 2: while a row of an item's
        16-row block is computed, the same row of the item's next block is requested towards L2 / L1 (a
        longer lead than prefetch_bytes: one core's GGUF reads from DRAM are bound by the misses it keeps in
        flight). Benchmarks compare the modes."""
        return int(native.lib().hm_pool_block_prefetch(self._h, -1))

    @block_prefetch.setter
    def block_prefetch(self, mode: int) -> None:
        if mode not in (0, 1, 2):
            raise ValueError(f"block_prefetch must be 0, 1 or 2, got {mode!r}")
        native.lib().hm_pool_block_prefetch(self._h, int(mode))

    @property
    def items_per_thread(self) -> int:
        """A decode-sized task's items are sized for about this many a thread (1-64, default 8): fewer make
        each item a longer weight stream (the prefetchers ramp up once per item) and the phase's tail longer.
        Benchmarks compare values."""
        return int(native.lib().hm_pool_items_per_thread(self._h, 0))

    @items_per_thread.setter
    def items_per_thread(self, n: int) -> None:
        if not isinstance(n, int) or not 1 <= n <= 64:
            raise ValueError(f"items_per_thread must be an int in [1, 64], got {n!r}")
        native.lib().hm_pool_items_per_thread(self._h, n)

    @property
    def reduce_inline_rows(self) -> int:
        """Rows (tokens x top-k) up to which a MoE task's weighted sum of the experts' outputs runs on the
        leader thread alone (default 16: decode sizes); above, on all threads. Benchmarks compare."""
        return int(native.lib().hm_pool_reduce_inline(self._h, -1))

    @reduce_inline_rows.setter
    def reduce_inline_rows(self, rows: int) -> None:
        if not 0 <= rows <= 1 << 30:
            raise ValueError(f"reduce_inline_rows must be in [0, 2^30], got {rows}")
        native.lib().hm_pool_reduce_inline(self._h, int(rows))

    @property
    def leader_spin_us(self) -> int:
        """How long the leader thread spins for its next task once its queue is empty before it sleeps
        (us; -1: the pool's spin_us). 0 frees its core at once for a caller leading inline phases."""
        return int(native.lib().hm_pool_leader_spin(self._h, -2))

    @leader_spin_us.setter
    def leader_spin_us(self, us: int) -> None:
        if not -1 <= int(us) <= 10**6:
            raise ValueError(f"leader_spin_us must be in [-1, 1e6], got {us}")
        native.lib().hm_pool_leader_spin(self._h, int(us))

    def stream_read_gbps(self, nbytes: int = 1 << 30, iters: int = 5) -> float:
        """Stream-read bandwidth measured with this pool's threads (GB/s)."""
        return native.lib().hm_stream_read(self._h, int(nbytes), int(iters))

    def trace_start(self, capacity: int = 1 << 16) -> None:
        """Record when each task is submitted, starts and ends, and when host functions wait for
        it (hybridmoe.cpu.trace reads them); call while no task is queued."""
        self._trace_cap = int(capacity)
        native.lib().hm_trace_start(self._h, self._trace_cap)

    def trace_stop(self) -> torch.Tensor:
        """Stop recording; the events as an int64 tensor [n, 3] of (t_ns, task id, kind), kinds in
        hybridmoe.cpu.trace.KINDS. Call once the traced tasks and host functions are done."""
        cap = getattr(self, "_trace_cap", 0)
        buf = torch.zeros(max(cap, 1), 4, dtype=torch.int64)
        n = native.lib().hm_trace_stop(self._h, C.cast(buf.data_ptr(), C.POINTER(C.c_int64)), cap)
        return buf[: min(n, cap), :3].clone()


_default_pool: CPUThreadPool | None = None
_pool_lock = threading.Lock()


def default_pool(threads: int | None = None, threadpool_count: int = 1, numa_nodes: list[int] | None = None,
                 settings: CPUEngineSettings | None = None) -> CPUThreadPool:
    """The process-wide pool, created on first use with these arguments (later calls get that pool
    whatever they pass)."""
    global _default_pool
    with _pool_lock:
        if _default_pool is None:
            _default_pool = CPUThreadPool(threads, threadpool_count, numa_nodes, settings)
            atexit.register(_close_default_pool)  # join the native threads before interpreter teardown
        return _default_pool


def _close_default_pool() -> None:
    if _default_pool is not None:
        _default_pool.close()


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _mat(m: PackedMatrix, e: int) -> native.PackedMat:
    return native.PackedMat(_ptr(m.data), m.data.numel() // e, _ptr(m.scale), _ptr(m.zero), _ptr(m.wsum), m.n, m.k)


class CPUMoELayer:
    """One layer's routed experts on the CPU engine."""

    lora: CPULoRASlots | None = None  # expert LoRA slots (attach_lora); tasks take lora_idx then

    def __init__(
        self,
        packed: PackedLayer,
        isa: str | None = None,
        pool: CPUThreadPool | None = None,
        act_alpha: float = 1.702,
        act_limit: float = 7.0,
    ):
        self.packed = packed
        self.isa = native.resolve_isa(isa)
        self.pool = pool or default_pool()
        for name, t in packed.tensors().items():
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"packed tensor {name} must be a contiguous CPU tensor")
        p = packed
        self._desc = native.LayerDesc(
            method_code(p.method),
            p.num_experts,
            p.hidden,
            p.inter,
            p.hidden_pad,
            p.inter_pad,
            p.group_size,
            ACTIVATIONS[p.activation],
            act_alpha,
            act_limit,
            _mat(p.w13, p.num_experts),
            _mat(p.w2, p.num_experts),
        )
        err = C.create_string_buffer(512)
        h = native.lib().hm_layer_create(C.byref(self._desc), native.ISAS[self.isa], err, len(err))
        if not h:
            raise native.CpuIsaError(f"cannot create CPU MoE layer on {self.isa!r}: {err.value.decode()}")
        self._h = h
        self.kernel_name = native.lib().hm_layer_kernel_name(h).decode()
        self.numa_unplaced = 0
        if self.pool.subpools > 1:  # each sub-pool's rows into its node's memory
            nodes = self.pool.subpool_nodes()
            arr = (C.c_int * len(nodes))(*nodes)
            self.numa_unplaced = native.lib().hm_layer_bind_numa(h, arr, len(nodes))

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:
            try:
                if self.pool.handle:  # a closed pool has already finished every task
                    self.pool.sync(max_pending=0)
            except Exception:
                pass
            native.lib().hm_layer_destroy(h)
            self._h = None

    # ---- expert LoRA (lora_slots.py; the interface hybridmoe/lora/cpu_bridge.py uses) ----
    def attach_lora(self, layer_index: int, slots: int, max_rank: int, dtype: torch.dtype = torch.bfloat16) -> None:
        """Zeroed LoRA slots for this layer's experts (once; host memory: lora.nbytes())."""
        if self.lora is not None:
            raise ValueError(f"layer {layer_index}: LoRA slots are already attached")
        p = self.packed
        self.pool.sync(max_pending=0)  # no queued task may see the descriptor change
        self.lora = CPULoRASlots(self._h, p.num_experts, p.hidden, p.inter, getattr(p, "hidden_pad", p.hidden),
                                 getattr(p, "inter_pad", p.inter), slots, max_rank, dtype,
                                 what=f"layer {layer_index} CPU experts ({p.method})")

    def set_lora_slot(self, layer_index: int, slot: int, gate_A, gate_B, up_A, up_B, down_A, down_B,
                      scaling: float) -> None:
        """Loads an adapter's expert weights (A [E, r, in], B [E, out, r]) into `slot`."""
        self._lora(layer_index).set_slot(slot, gate_A, gate_B, up_A, up_B, down_A, down_B, scaling)

    def clear_lora_slot(self, layer_index: int, slot: int) -> None:
        self._lora(layer_index).clear_slot(slot)

    def _lora(self, layer_index: int) -> CPULoRASlots:
        if self.lora is None:
            raise ValueError(f"layer {layer_index}: no LoRA slots attached (attach_lora)")
        return self.lora

    def make_task(self, x, topk_ids, topk_weights, out, accumulate=False, skip_mask=None, lora_idx=None,
                  nan_rows=False, ids2=None, out2=None, done1=None):
        """Validates and converts the arguments; returns (Task struct, tensors to keep alive, out).
        lora_idx: int32 [T] adapter slot per token (-1: none), read only with LoRA attached. nan_rows: a token
        whose own values are non-finite (input row, routing weight, expert activation) gets a NaN output row
        instead of failing the task (CPUMoEError naming it). ids2 / out2: a second group of pairs (like topk_ids,
        weighted by topk_weights) into an output of its own (like out), run after the first group in the same
        task; done1: an int32 [1] CPU tensor set to 1 once `out` is written (also when the task fails)."""
        p = self.packed
        if x.dim() != 2 or x.shape[1] != p.hidden:
            raise ValueError(f"x must be [T, {p.hidden}], got {tuple(x.shape)}")
        t = x.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_ids/topk_weights must both be [T={t}, K], got {tuple(topk_ids.shape)} and "
                f"{tuple(topk_weights.shape)}"
            )
        if not 1 <= topk_ids.shape[1] <= 256:
            raise ValueError("K must be in [1, 256]")
        for name, v in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("out", out)):
            if v.device.type != "cpu" or not v.is_contiguous():
                raise ValueError(f"{name} must be a contiguous CPU tensor")
        if x.dtype not in (torch.float32, torch.bfloat16) or out.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("x and out must be float32 or bfloat16")
        if out.shape != x.shape:
            raise ValueError(f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.dtype != torch.float32:
            raise ValueError("topk_ids must be int32/int64 and topk_weights float32")
        if skip_mask is not None:
            if skip_mask.shape != (p.num_experts,) or skip_mask.device.type != "cpu":
                raise ValueError(f"skip_mask must be a CPU tensor [{p.num_experts}]")
            skip_mask = skip_mask.to(torch.uint8).contiguous()
        lora_idx = check_lora_idx(lora_idx, t, self.lora is not None)
        if (ids2 is None) != (out2 is None):
            raise ValueError("ids2 and out2 go together (a second pair group and its output)")
        if ids2 is not None:
            if ids2.shape != topk_ids.shape or ids2.dtype != topk_ids.dtype or ids2.device.type != "cpu" \
                    or not ids2.is_contiguous():
                raise ValueError(f"ids2 must be a contiguous CPU tensor like topk_ids ({tuple(topk_ids.shape)}, "
                                 f"{topk_ids.dtype}), got {tuple(ids2.shape)} {ids2.dtype}")
            if out2.shape != out.shape or out2.dtype != out.dtype or out2.device.type != "cpu" \
                    or not out2.is_contiguous():
                raise ValueError(f"out2 must be a contiguous CPU tensor like out ({tuple(out.shape)}, {out.dtype})")
        if done1 is not None and (done1.dtype != torch.int32 or done1.numel() < 1 or done1.device.type != "cpu"):
            raise ValueError("done1 must be an int32 CPU tensor of at least one element")
        task = native.Task(
            self._h,
            _ptr(x),
            _ptr(topk_ids),
            _ptr(topk_weights),
            _ptr(skip_mask),
            _ptr(out),
            t,
            topk_ids.shape[1],
            native.DT_BF16 if x.dtype == torch.bfloat16 else native.DT_F32,
            1 if topk_ids.dtype == torch.int64 else 0,
            native.DT_BF16 if out.dtype == torch.bfloat16 else native.DT_F32,
            1 if accumulate else 0,
            1 if nan_rows else 0,
            _ptr(lora_idx),
            _ptr(ids2),
            _ptr(out2),
            _ptr(done1),
        )
        return task, (x, topk_ids, topk_weights, out, skip_mask, lora_idx, ids2, out2, done1)

    def submit(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool = False,
        skip_mask: torch.Tensor | None = None,
        lora_idx: torch.Tensor | None = None,
    ) -> int:
        """Queues out[T, H] (+)= MoE(x); returns a task id at once. All tensors: contiguous CPU (pinned for
        GPU overlap); they must stay unchanged until sync. lora_idx: int32 [T] (see make_task)."""
        task, keep = self.make_task(x, topk_ids, topk_weights, out, accumulate, skip_mask, lora_idx)
        return self.pool.submit(task, keep)

    def sync(self, task_id: int | None = None, max_pending: int = 0) -> None:
        self.pool.sync(task_id, max_pending)

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        skip_mask: torch.Tensor | None = None,
        lora_idx: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronous: returns out (allocated in x's dtype when not given; any device/dtype input is
        copied to CPU float32/bfloat16 first)."""
        xc = x.detach().to("cpu")
        if xc.dtype not in (torch.float32, torch.bfloat16):
            xc = xc.float()
        xc = xc.contiguous()
        ids = topk_ids.detach().to("cpu").contiguous()
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.long()
        w = topk_weights.detach().to("cpu", torch.float32).contiguous()
        res = out if out is not None else torch.empty(xc.shape, dtype=xc.dtype)
        skip = skip_mask.detach().to("cpu") if skip_mask is not None else None
        li = lora_idx.detach().to("cpu", torch.int32).contiguous() if lora_idx is not None else None
        task, _keep = self.make_task(xc, ids, w, res, accumulate, skip, li)
        self.run(task)
        return res

    def run(self, task: native.Task) -> None:
        """Runs a task from make_task and waits for it: on this thread in the pool leader's place when
        the pool is idle (no hand-off, no wake-up: the synchronous CPU-only path), else queued behind
        the pool's tasks. Raises CPUMoEError on failure (this task's, or an earlier unsynced one's)."""
        if not self.pool.handle:
            raise CPUMoEError("the CPU thread pool is closed")
        err = self.__dict__.get("_err")
        if err is None:  # made on first use (subclasses do not call our __init__)
            err = self._err = C.create_string_buffer(1024)
        if native.lib().hm_run_task(self.pool.handle, C.byref(task), -1, err, len(err)):
            raise CPUMoEError(err.value.decode())
