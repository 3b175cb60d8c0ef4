"""The engine's contract: asynchronous in-order tasks, errors that reach Python, ISA forcing, the
pool's settings (CPUEngineSettings), the stream-read probe, and the "cpu" experts backend.
(The CUDA host-function entry points and gated submits: test_cpu_hostcalls.py.)"""

import ctypes as C
import dataclasses

import pytest
import torch

from hybridmoe import envs
from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.cpu.reference import moe_reference, rel_error
from hybridmoe.cpu.settings import CPUEngineSettings


def test_async_in_order(layer, inputs):
    h = layer.packed.hidden
    x1, i1, w1 = inputs(4, 1)
    x2, i2, w2 = inputs(4, 2)
    r1, r2 = layer.forward(x1, i1, w1), layer.forward(x2, i2, w2)
    out = torch.zeros(4, h)
    a = layer.submit(x1, i1, w1, out)  # overwrite
    b = layer.submit(x2, i2, w2, out, accumulate=True)  # then add: only right if run in order
    assert b == a + 1
    layer.sync(b)
    assert torch.allclose(out, r1 + r2, atol=1e-5)
    ids = [layer.submit(x1, i1, w1, torch.empty(4, h)) for _ in range(5)]
    layer.sync(max_pending=2)
    assert layer.pool.pending() <= 2
    layer.sync()
    assert layer.pool.pending() == 0 and ids[-1] > ids[0]


def test_failing_task_raises_and_next_runs(layer, inputs):
    x, ids, w = inputs(3)
    good = layer.forward(x, ids, w)
    bad_ids = ids.clone()
    bad_ids[1, 0] = layer.packed.num_experts + 3
    layer.submit(x, bad_ids, w, torch.empty(3, layer.packed.hidden))
    with pytest.raises(CPUMoEError, match="out of range"):
        layer.sync()
    xn = x.clone()
    xn[2, 5] = float("nan")
    with pytest.raises(CPUMoEError, match="NaN") as err:
        layer.forward(xn, ids, w)
    assert err.value.token == 2  # the engine fails that token's request alone (Engine._fail_culprit)
    assert torch.equal(layer.forward(x, ids, w), good)


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
@pytest.mark.parametrize("t", [1, 5, 40])
def test_non_finite_errors_name_their_token(pool, method, t):
    """Each per-token error names the token (CPUMoEError.token): a non-finite input row, a non-finite
    routing weight, an expert activation that overflows; an error of the whole task names none."""
    g = torch.Generator().manual_seed(t)
    layer = CPUMoELayer(pack_layer(torch.randn(6, 64, 128, generator=g) * 0.05,
                                   torch.randn(6, 128, 32, generator=g) * 0.05, method), pool=pool)
    x, w = torch.randn(t, 128, generator=g), torch.rand(t, 2, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)]).to(torch.int32)
    bad = t // 2
    cases = [("input", lambda x, w: x.__setitem__((bad, 7), float("nan")), "input x holds NaN or Inf"),
             ("weight", lambda x, w: w.__setitem__((bad, 1), float("inf")), "non-finite routing weight"),
             ("overflow", lambda x, w: x.__setitem__((bad, slice(0, 4)), 3e38), "expert activation holds NaN")]
    for _, poison, words in cases:
        xb, wb = x.clone(), w.clone()
        poison(xb, wb)
        with pytest.raises(CPUMoEError, match=words) as err:
            layer.forward(xb, ids, wb)
        assert err.value.token == bad, str(err.value)
    wrong = ids.clone()
    wrong[bad, 0] = 99
    with pytest.raises(CPUMoEError, match="out of range") as err:
        layer.forward(x, wrong, w)
    assert err.value.token is None


def test_bad_shapes_raise_at_submit(layer, inputs):
    h = layer.packed.hidden
    x, ids, w = inputs(3)
    with pytest.raises(ValueError):
        layer.submit(x[:, :-1].contiguous(), ids, w, torch.empty(3, h - 1))
    with pytest.raises(ValueError):
        layer.submit(x, ids[:2], w[:2], torch.empty(3, h))
    with pytest.raises(ValueError):
        layer.submit(x, ids, w, torch.empty(3, h + 1))


def test_negative_id_means_no_expert(layer, inputs):
    x, ids, w = inputs(5)
    ids[0, 1] = -1
    p = layer.packed
    ref = moe_reference(x, ids, w, *p.dequantized(), act_quant="int8")
    assert rel_error(layer.forward(x, ids, w), ref) < 2e-3


def test_half_and_float64_inputs_via_forward(layer, inputs):
    x, ids, w = inputs(3)
    ref = layer.forward(x, ids, w)
    out = layer.forward(x.half(), ids.int(), w.double())
    assert out.dtype == torch.float32 and rel_error(out, ref) < 0.04  # fp16 input re-rolls the int8 rounding


def test_forced_isa_missing_is_a_clear_error(weights, pool, monkeypatch):
    missing = [isa for isa in native.ISAS if native.isa_missing(isa)]
    if not missing:
        pytest.skip("this CPU has every ISA path")
    monkeypatch.setenv(envs.CPU_ISA, missing[-1])
    with pytest.raises(native.CpuIsaError, match="cannot run here"):
        CPUMoELayer(pack_layer(*weights, "BF16"), pool=pool)
    with pytest.raises(native.CpuIsaError, match="unknown"):
        native.resolve_isa("sse2")


def test_env_forces_available_isa(weights, pool, monkeypatch):
    monkeypatch.setenv(envs.CPU_ISA, "avx2")
    assert CPUMoELayer(pack_layer(*weights, "BF16"), pool=pool).kernel_name == "avx2"


def test_stream_read(pool):
    assert pool.stream_read_gbps(16 << 20, 2) > 0.1


def test_cpu_backend_registered(weights, inputs):
    from hybridmoe.config import HybridConfig
    from hybridmoe.moe import cpu_experts
    from hybridmoe.moe.experts import EXPERTS_BACKENDS, ExpertWeights
    from hybridmoe.moe.options import ExpertsOptions

    assert EXPERTS_BACKENDS.get("cpu") is cpu_experts.make_cpu_experts
    ew = ExpertWeights(weights[0].bfloat16(), weights[1].bfloat16())
    opts = ExpertsOptions(hybrid=HybridConfig(method="AMXINT4", cpuinfer=2, group_size=64))
    be = cpu_experts.make_cpu_experts(ew, 0, opts)
    x, ids, w = inputs(4)
    y = be.forward(x.bfloat16(), ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = moe_reference(x, ids, w, weights[0].bfloat16().float(), weights[1].bfloat16().float())
    assert rel_error(y.float(), ref) < 0.3


def test_subpools_and_numa_binding(weights, inputs):
    pool2 = CPUThreadPool(threads=2, threadpool_count=2)
    try:
        assert pool2.subpools == 2
        for method in ("AMXINT8", "AMXINT4"):
            p = pack_layer(*weights, method, group_size=64)
            lay = CPUMoELayer(p, pool=pool2)  # binds each sub-pool's rows to its node (node 0 here)
            assert lay.numa_unplaced >= 0
            x, ids, w = inputs(70)
            ref = moe_reference(x, ids, w, *p.dequantized(), act_quant="int8")
            assert rel_error(lay.forward(x, ids, w), ref) < 2e-3
            del lay
    finally:
        pool2.close()


@pytest.mark.parametrize("spin_us", [0, 5000])
def test_many_tasks_sleeping_and_spinning_pool(weights, inputs, spin_us):
    """Hundreds of small tasks through a pool whose threads sleep between phases (spin 0) or spin:
    in-order accumulation must come out exact."""
    pool3 = CPUThreadPool(threads=3, settings=CPUEngineSettings(spin_us=spin_us))
    try:
        assert pool3.native_settings().spin_us == spin_us
        lay = CPUMoELayer(pack_layer(*weights, "AMXINT8"), pool=pool3)
        x, ids, w = inputs(3, 5)
        one = lay.forward(x, ids, w)
        out = torch.zeros_like(x)
        for j in range(150):
            lay.submit(x, ids, w, out, accumulate=j > 0)
            if j % 50 == 49:
                lay.sync(max_pending=3)
        lay.sync()
        assert torch.allclose(out, one * 150, rtol=1e-4, atol=1e-4)
        del lay
    finally:
        pool3.close()


@pytest.mark.parametrize("method", ["AMXINT8", "BF16"])
def test_light_phases_do_every_piece(method):
    """The task's light phases (x conversion, gather, activation conversion, reduce) run on all threads
    once a task has more than a few rows, their pieces claimed from a counter in a dynamic phase: with
    the pool's threads asleep between phases (spin 0) they often join after the pieces are all taken.
    Every task, on fresh inputs (a skipped piece would leave the previous task's rows), gives bit for bit
    what it gives with dynamic phases off (every phase waits for every thread) and on a one-thread pool
    (every phase on the leader, whole)."""
    g = torch.Generator().manual_seed(11)
    e, h, i, k = 6, 256, 128, 4
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1, method)
    pool3 = CPUThreadPool(threads=3, settings=CPUEngineSettings(spin_us=0))
    pool1 = CPUThreadPool(threads=1)
    try:
        lay = CPUMoELayer(packed, pool=pool3)
        lay1 = CPUMoELayer(packed, pool=pool1)
        for j in range(24):
            t = (5, 9, 40)[j % 3]  # T * K = 20 .. 160 slots: every light phase runs in parallel
            x = torch.randn(t, h, generator=g)
            ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
            w = torch.rand(t, k, generator=g)
            pool3.dynamic_phases = True
            on = lay.forward(x, ids, w)
            pool3.dynamic_phases = False
            off = lay.forward(x, ids, w)
            assert torch.equal(on, off), f"task {j} (T={t}) differs with dynamic light phases"
            assert torch.equal(on, lay1.forward(x, ids, w)), f"task {j} (T={t}) differs from one thread"
        pool3.dynamic_phases = True
        del lay, lay1
    finally:
        pool3.close()
        pool1.close()


@pytest.mark.parametrize("method", ["AMXINT8", "BF16"])
def test_fused_reduce_changes_nothing_but_speed(method):
    """CPUThreadPool.fused_reduce (default on): a one-token task sums its experts' outputs inside the down
    phase, each 256-column chunk by the thread that completes it, instead of in a phase after it. Bit for bit
    the same output, on fresh inputs (a chunk never summed would keep the previous task's values): H 640 (two
    whole chunks and a half one), experts skipped (the GPU's), accumulate into fp32 and bf16 outputs, a pool
    whose threads sleep between phases (they join late) and a one-thread pool; T > 1 ignores the setting."""
    g = torch.Generator().manual_seed(13)
    e, h, i, k = 7, 640, 128, 4
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1, method)
    pools = [CPUThreadPool(threads=3, settings=CPUEngineSettings(spin_us=0)), CPUThreadPool(threads=1)]
    try:
        assert all(p.fused_reduce for p in pools)
        for pool in pools:
            lay = CPUMoELayer(packed, pool=pool)
            for j in range(12):
                t = 1 if j < 10 else 3
                x = torch.randn(t, h, generator=g)
                ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
                w = torch.rand(t, k, generator=g)
                skip = torch.rand(e, generator=g) < 0.3 if j % 2 else None
                if skip is not None:
                    skip[ids[0, 0]] = False  # some expert stays on the CPU (none: nothing to sum)
                acc, dt = j % 3 == 1, (torch.float32, torch.bfloat16)[j % 4 == 3]
                base = torch.randn(t, h, generator=g).to(dt)
                outs = []
                for fused in (True, False):
                    pool.fused_reduce = fused
                    assert pool.fused_reduce == fused
                    o = base.clone()
                    outs.append(lay.forward(x, ids, w, out=o, accumulate=acc, skip_mask=skip))
                pool.fused_reduce = True
                assert torch.equal(outs[0], outs[1]), f"task {j} (T={t}, skip {skip is not None}, acc {acc}, {dt})"
                assert not torch.equal(outs[0], base), f"task {j}: nothing written"
            del lay
    finally:
        for p in pools:
            p.close()


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_fused_quant_changes_nothing_but_speed(method):
    """CPUThreadPool.fused_quant (default on): a task with at most 16 rows an expert converts each expert's
    activation rows for the down projection inside the gate/up phase, by the thread that completes the expert's
    last item, instead of in a phase after it; with chained_phases (default on) the down items run in that phase
    too, each once its expert's rows are converted. Every fuse mode gives bit for bit the same output on fresh
    inputs (a row never converted, or read before it is, would hold the previous task's values), fp32 and bf16 x
    (bf16 x on the BF16 fp32-activation kernel rounds the activation first), T = 1, 3, 5 and 40 (above 16 rows
    an expert: the phases as before), a pool whose threads sleep between phases and a one-thread pool."""
    g = torch.Generator().manual_seed(14)
    e, h, i, k = 7, 320, 192, 4
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1, method)
    pools = [CPUThreadPool(threads=3, settings=CPUEngineSettings(spin_us=0)), CPUThreadPool(threads=1)]
    try:
        assert all(p.fused_quant and p.fused_reduce and p.chained_phases and p.fuse_mode == "on" for p in pools)
        for pool in pools:
            lay = CPUMoELayer(packed, pool=pool)
            for j in range(12):
                t = (1, 3, 5, 40)[j % 4]
                x = torch.randn(t, h, generator=g).to((torch.float32, torch.bfloat16)[j % 3 == 2])
                ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
                w = torch.rand(t, k, generator=g)
                outs = []
                for fused in (True, False):
                    pool.fused_quant = fused
                    assert pool.fused_quant == fused and pool.fused_reduce  # one bit, not the other
                    outs.append(lay.forward(x, ids, w))
                pool.fused_quant = True
                for mode in ("nochain", "chain", "off", "on"):
                    pool.fuse_mode = mode
                    assert pool.fuse_mode == mode
                    outs.append(lay.forward(x, ids, w))
                for o, what in zip(outs[1:], ("fused_quant off", "nochain", "chain", "off", "on")):
                    assert torch.equal(outs[0], o), f"task {j} (T={t}, x {x.dtype}): {what}"
                assert outs[0].abs().sum() > 0, f"task {j}: nothing written"
            del lay
    finally:
        for p in pools:
            p.close()


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_items_per_thread_changes_nothing_but_speed(method):
    """CPUThreadPool.items_per_thread sizes a decode task's items (1: up to 32 N-blocks an item, 64: the minimum
    2 or 4): every output element still comes from one item with the same K order, so the outputs are bit for bit
    equal, at T = 1, 4 and 40 (above 16 rows an expert: items of their own size), with and without the fusions."""
    g = torch.Generator().manual_seed(15)
    e, h, i, k = 7, 320, 192, 4
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1, method)
    pool = CPUThreadPool(threads=3)
    try:
        assert pool.items_per_thread == 8
        lay = CPUMoELayer(packed, pool=pool)
        for j, t in enumerate((1, 4, 40, 1)):
            x = torch.randn(t, h, generator=g)
            ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
            w = torch.rand(t, k, generator=g)
            pool.fuse_mode = ("on", "off")[j % 2]
            outs = []
            for n in (8, 1, 2, 64):
                pool.items_per_thread = n
                assert pool.items_per_thread == n
                outs.append(lay.forward(x, ids, w))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"T={t}"
            assert outs[0].abs().sum() > 0
        for bad in (0, 65, 2.0):
            with pytest.raises(ValueError, match="items_per_thread"):
                pool.items_per_thread = bad
        del lay
    finally:
        pool.close()


@pytest.mark.parametrize("method", ["AMXINT8", "BF16"])
def test_reduce_inline_rows_changes_nothing_but_speed(method):
    """CPUThreadPool.reduce_inline_rows moves a task's weighted sum between the leader alone and all threads:
    the same sum per output row either way (bit for bit), for T * K below, at and above the default 16."""
    g = torch.Generator().manual_seed(12)
    e, h, i, k = 6, 256, 128, 4
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1, method)
    pool3 = CPUThreadPool(threads=3)
    try:
        assert pool3.reduce_inline_rows == 16
        lay = CPUMoELayer(packed, pool=pool3)
        for t in (1, 3, 4, 5, 40):
            x = torch.randn(t, h, generator=g)
            ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
            w = torch.rand(t, k, generator=g)
            outs = []
            for rows in (0, 16, 1 << 30):
                pool3.reduce_inline_rows = rows
                assert pool3.reduce_inline_rows == rows
                outs.append(lay.forward(x, ids, w))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"T={t}"
        with pytest.raises(ValueError, match="reduce_inline_rows"):
            pool3.reduce_inline_rows = -1
        del lay
    finally:
        pool3.close()


def test_numa_nodes_option():
    """--kt-numa-nodes: the pool's cores come from the listed nodes, one sub-pool per node at least;
    a node the machine lacks is a clear error, at config validation and when a pool is built."""
    from hybridmoe.config import ConfigError, EngineArgs
    from hybridmoe.cpu.topology import node_of, numa_nodes, parse_node_list, plan_threads

    nodes = sorted(numa_nodes())
    cpus, nsub = plan_threads(None, 1, nodes[:1])
    assert cpus and all(node_of(c) == nodes[0] for c in cpus) and nsub == 1
    pool = CPUThreadPool(1, 1, nodes[:1])
    assert pool.threads == 1 and node_of(pool.cpus[0]) == nodes[0]
    pool.close()
    with pytest.raises(ValueError, match=r"--kt-numa-nodes: node\(s\) \[99\] not on this machine"):
        plan_threads(None, 1, [99])
    assert parse_node_list("0-2,5") == [0, 1, 2, 5]
    EngineArgs(kt_numa_nodes=",".join(map(str, nodes))).validate()
    for bad in ("x", "99"):
        with pytest.raises(ConfigError, match="--kt-numa-nodes"):
            EngineArgs(kt_numa_nodes=bad).validate()


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16", "FP8"])
def test_prefetch_distance_changes_nothing_but_speed(method):
    """The few-row kernels' software prefetch (CPUEngineSettings.prefetch_bytes, given to the pool
    when it is created) reads ahead of, and past the end of, the weights: results are bit-identical
    to no prefetch."""
    g = torch.Generator().manual_seed(5)
    e, h, i, k, t = 6, 128, 64, 3, 5
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1,
                        method, group_size=64)
    x = torch.randn(t, h, generator=g)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(t, k, generator=g)
    outs = []
    for pf in (0, 256, 4096, 1 << 20):
        pool = CPUThreadPool(threads=2, settings=CPUEngineSettings(prefetch_bytes=pf))
        try:
            assert pool.native_settings().prefetch_bytes == pf
            outs.append(CPUMoELayer(packed, pool=pool).forward(x, ids, w))
        finally:
            pool.close()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_settings_are_validated_and_reach_the_pool():
    """CPUEngineSettings rejects out-of-range values with the field's name; the native pool keeps
    what it was created with, and refuses invalid settings itself (a caller bypassing the class)."""
    s = CPUEngineSettings(prefetch_bytes=512, spin_us=7, hostfn_spin_us=-1, gate_timeout_s=2.5)
    pool = CPUThreadPool(threads=1, settings=s)
    try:
        assert pool.settings is s and pool.native_settings() == s
    finally:
        pool.close()
    bad = [("prefetch_bytes", -1), ("prefetch_bytes", (1 << 20) + 1), ("prefetch_bytes", 1.5), ("spin_us", -1),
           ("spin_us", True), ("hostfn_spin_us", -2), ("gate_timeout_s", 0), ("gate_timeout_s", float("nan")),
           ("gate_timeout_s", "60")]
    for field, value in bad:
        with pytest.raises(ValueError, match=rf"CPUEngineSettings\.{field}="):
            dataclasses.replace(CPUEngineSettings(), **{field: value})
    with pytest.raises(TypeError, match="CPUEngineSettings"):
        CPUThreadPool(threads=1, settings={"spin_us": 0})
    lib, err = native.lib(), C.create_string_buffer(256)
    cpus = (C.c_int * 1)(-1)
    for raw, field in (((-5, 1000, 0, 60.0), "prefetch_bytes"), ((2048, 1000, 0, -1.0), "gate_timeout_s")):
        assert not lib.hm_pool_create(1, cpus, 1, C.byref(native.PoolSettings(*raw)), err, len(err))
        assert field in err.value.decode()


def test_prefetch_default_follows_the_cpu_vendor(monkeypatch):
    """4096 on Intel and 0 on AMD with AVX-512, 2048 elsewhere (CPUEngineSettings.prefetch_bytes' measurements); explicit
    values win."""
    from hybridmoe.cpu import settings

    avx512 = {"avx2", "avx512f", "avx512bw", "avx512_vnni"}
    for vendor, flags, want in (("AuthenticAMD", avx512, 0), ("AuthenticAMD", {"avx2", "fma"}, 2048),
                                ("GenuineIntel", avx512, 4096), ("GenuineIntel", {"avx2", "fma"}, 2048),
                                ("", set(), 2048)):
        monkeypatch.setattr(settings, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(settings, "cpu_flags", lambda f=flags: f)
        assert settings.default_prefetch_bytes() == want
        assert CPUEngineSettings().prefetch_bytes == want
        assert CPUEngineSettings(prefetch_bytes=512).prefetch_bytes == 512
    monkeypatch.undo()
    info = open("/proc/cpuinfo").read()
    assert settings.cpu_vendor() in info and ("avx2" in settings.cpu_flags()) == (" avx2" in info)


def test_threads_for_tests_variable(monkeypatch):
    monkeypatch.delenv(envs.TEST_THREADS, raising=False)
    assert envs.threads_for_tests() == 2
    monkeypatch.setenv(envs.TEST_THREADS, "5")
    assert envs.threads_for_tests() == 5
    for bad in ("0", "x"):
        monkeypatch.setenv(envs.TEST_THREADS, bad)
        with pytest.raises(ValueError, match=envs.TEST_THREADS):
            envs.threads_for_tests()


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
@pytest.mark.parametrize("t", [1, 5, 40])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_nan_rows_mode_isolates_the_bad_tokens(pool, method, t, out_dtype):
    """HmTask.nan_rows (the CUDA path's tasks): the tokens whose own values are non-finite (an input row, a
    routing weight, an overflowing expert activation) get a NaN output row and the task succeeds; every other
    row is bit-identical to the same task without the poison, with and without accumulate. (With it off, the
    same poisons fail the task: test_non_finite_errors_name_their_token.)"""
    g = torch.Generator().manual_seed(100 + t)
    layer = CPUMoELayer(pack_layer(torch.randn(6, 64, 128, generator=g) * 0.05,
                                   torch.randn(6, 128, 32, generator=g) * 0.05, method), pool=pool)
    x, w = torch.randn(t, 128, generator=g), torch.rand(t, 2, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(t)]).to(torch.int32)
    bad = sorted({t // 2, t - 1, 0}) if t > 1 else [0]
    xb, wb = x.clone(), w.clone()
    poisons = [lambda r: xb.__setitem__((r, 7), float("nan")), lambda r: wb.__setitem__((r, 1), float("inf")),
               lambda r: xb.__setitem__((r, slice(0, 4)), 3e38)]
    for i, r in enumerate(bad):
        poisons[(i + t) % 3](r)
    for accumulate in (False, True):
        base = torch.randn(t, 128, generator=g).to(out_dtype)
        ref, out = base.clone(), base.clone()
        layer.sync(layer.submit(x, ids, w, ref, accumulate=accumulate))
        task, keep = layer.make_task(xb, ids, wb, out, accumulate=accumulate, nan_rows=True)
        pool.sync(pool.submit(task, keep))  # no CPUMoEError
        good = [r for r in range(t) if r not in bad]
        assert out[bad].isnan().all(), (method, t, accumulate)
        if method != "BF16":  # integer sums: bit for bit
            assert torch.equal(out[good], ref[good])
        else:  # a dropped pair changes its expert's row count, which may move it between the AMX tile and
            # the few-row kernels (fp32 sums in another order: a last-bit difference, one bf16 ulp at most)
            tol = 1e-5 if out_dtype == torch.float32 else 8e-3
            torch.testing.assert_close(out[good], ref[good], rtol=tol, atol=tol)


def test_amx_emulation_is_never_the_default(weights, pool):
    # tests/conftest.py sets HYBRIDMOE_AMX_EMULATE=1: where the CPU lacks AMX but has AVX-512, the "amx" path
    # runs on the software model of the tiles (csrc/amx_tiles.h), but only when asked for by name
    if not native.amx_emulated():
        pytest.skip("the AMX tiles are not emulated here (AMX present, no AVX-512, or HYBRIDMOE_AMX_EMULATE unset)")
    if envs.cpu_isa():
        pytest.skip("HYBRIDMOE_CPU_ISA picks the path")
    assert "amx" in native.available_isas() and native.best_isa() == "avx512"
    assert CPUMoELayer(pack_layer(*weights, "AMXINT8"), pool=pool).kernel_name == "avx512"
    assert CPUMoELayer(pack_layer(*weights, "AMXINT8"), isa="amx", pool=pool).kernel_name == "amx-emulated"


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_second_pair_group_equals_its_own_task(method):
    """HmTask.ids2 / out2 (a layer's deferred pairs run in its immediate task, after them): each output is bit
    for bit what a task of that group alone gives, at T = 1 (the fused per-group sum) and T = 5 / 40 (an expert
    with rows of both groups), with the fusions on and off, accumulating and not, bf16 outputs, a group with no
    pair on the CPU, and the same expert in both groups of one token; done1 is set (here once the task is over).
    The first group's items are queued first, so its output is not held up by the second group's."""
    g = torch.Generator().manual_seed(31)
    e, h, i, k = 9, 320, 192, 6
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1, method)
    pool = CPUThreadPool(threads=3)
    err = C.create_string_buffer(512)

    def run(task) -> None:
        assert native.lib().hm_run_task(pool.handle, C.byref(task), -1, err, len(err)) == 0, err.value

    try:
        lay = CPUMoELayer(packed, pool=pool)
        tiles_round_differently = lay.kernel_name.startswith("amx") and method != "AMXINT8"
        cases = [(1, "on", False, torch.float32, "split"), (1, "off", False, torch.float32, "split"),
                 (1, "on", True, torch.bfloat16, "split"), (1, "on", False, torch.float32, "empty0"),
                 (1, "on", False, torch.float32, "empty1"), (1, "on", False, torch.float32, "both"),
                 (5, "on", False, torch.float32, "split"), (40, "on", True, torch.float32, "split"),
                 (40, "off", False, torch.bfloat16, "split")]
        for t, fuse, acc, odt, kind in cases:
            pool.fuse_mode = fuse
            x = torch.randn(t, h, generator=g).to(torch.bfloat16)
            ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
            w = torch.rand(t, k, generator=g)
            later = torch.rand(t, k, generator=g) < 0.4  # each pair's group
            if kind == "empty0":
                later[:] = True
            elif kind == "empty1":
                later[:] = False
            ids1 = torch.where(later, -1, ids).contiguous()
            ids2 = torch.where(later, ids, -1).contiguous()
            if kind == "both":  # token 0's first expert in both groups
                ids2[0, 0] = ids1[0, 0] = ids[0, 0]
            base = [torch.randn(t, h, generator=g).to(odt) if acc else torch.zeros(t, h, dtype=odt) for _ in range(2)]
            want = [b.clone() for b in base]
            for ids_g, o in zip((ids1, ids2), want):
                task, keep = lay.make_task(x, ids_g, w, o, accumulate=acc)
                run(task)
            got = [b.clone() for b in base]
            done1 = torch.zeros(1, dtype=torch.int32)
            task, keep = lay.make_task(x, ids1, w, got[0], accumulate=acc, ids2=ids2, out2=got[1], done1=done1)
            run(task)
            case = (t, fuse, acc, odt, kind)
            if tiles_round_differently and t == 40:
                # On the AMX path an expert's rows go to the tile kernel from AMX_MIN_ROWS (16) rows on, to
                # the AVX-512 one below: run together, both groups' rows of an expert (~27 here) take the tile
                # kernel, run alone a group's ~11 the AVX-512 one, whose fp32 sums are added in another order.
                # INT8's integer dots are exact on both; INT4's group scales and BF16 round per path, and the
                # down projection's input is rounded to bf16 (or quantized) after that: ~1e-3 apart here on
                # outputs of magnitude ~1-15 (a lost or doubled pair would be ~1 apart).
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=lambda m, c=case: f"{c}: {m}")
            else:
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case
            assert done1.item() == 1 and (kind == "empty0" or got[0].ne(base[0]).any()), case
        with pytest.raises(ValueError, match="ids2 and out2 go together"):
            lay.make_task(x, ids1, w, got[0], ids2=ids2)
        with pytest.raises(ValueError, match="ids2 must be"):
            lay.make_task(x, ids1, w, got[0], ids2=ids2[:, :2].contiguous(), out2=got[1])
        del lay
    finally:
        pool.close()
