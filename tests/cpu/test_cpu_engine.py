"""The engine's contract: asynchronous in-order tasks, errors that reach Python, ISA forcing, the
host-function entry points, the stream-read probe, and the "cpu" experts backend."""

import ctypes as C
import itertools
import time

import pytest
import torch

from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.cpu.reference import moe_reference, rel_error

E, H, INTER, K = 8, 128, 64, 2


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, H, generator=g) / H**0.5, torch.randn(E, H, INTER, generator=g) / INTER**0.5


@pytest.fixture(scope="module")
def layer(weights, pool):
    try:
        return CPUMoELayer(pack_layer(*weights, "AMXINT8"), pool=pool)
    except native.CpuIsaError as e:  # HYBRIDMOE_CPU_ISA forces a path this CPU lacks
        pytest.skip(str(e))


def inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), torch.randint(0, E, (t, K), generator=g), torch.rand(t, K, generator=g)


def test_async_in_order(layer):
    x1, i1, w1 = inputs(4, 1)
    x2, i2, w2 = inputs(4, 2)
    r1, r2 = layer.forward(x1, i1, w1), layer.forward(x2, i2, w2)
    out = torch.zeros(4, H)
    a = layer.submit(x1, i1, w1, out)  # overwrite
    b = layer.submit(x2, i2, w2, out, accumulate=True)  # then add: only right if run in order
    assert b == a + 1
    layer.sync(b)
    assert torch.allclose(out, r1 + r2, atol=1e-5)
    ids = [layer.submit(x1, i1, w1, torch.empty(4, H)) for _ in range(5)]
    layer.sync(max_pending=2)
    assert layer.pool.pending() <= 2
    layer.sync()
    assert layer.pool.pending() == 0 and ids[-1] > ids[0]


def test_failing_task_raises_and_next_runs(layer):
    x, ids, w = inputs(3)
    good = layer.forward(x, ids, w)
    bad_ids = ids.clone()
    bad_ids[1, 0] = E + 3
    layer.submit(x, bad_ids, w, torch.empty(3, H))
    with pytest.raises(CPUMoEError, match="out of range"):
        layer.sync()
    xn = x.clone()
    xn[2, 5] = float("nan")
    with pytest.raises(CPUMoEError, match="NaN"):
        layer.forward(xn, ids, w)
    assert torch.equal(layer.forward(x, ids, w), good)


def test_bad_shapes_raise_at_submit(layer):
    x, ids, w = inputs(3)
    with pytest.raises(ValueError):
        layer.submit(x[:, :-1].contiguous(), ids, w, torch.empty(3, H - 1))
    with pytest.raises(ValueError):
        layer.submit(x, ids[:2], w[:2], torch.empty(3, H))
    with pytest.raises(ValueError):
        layer.submit(x, ids, w, torch.empty(3, H + 1))


def test_negative_id_means_no_expert(layer, weights):
    x, ids, w = inputs(5)
    ids[0, 1] = -1
    p = layer.packed
    ref = moe_reference(x, ids, w, *p.dequantized(), act_quant="int8")
    assert rel_error(layer.forward(x, ids, w), ref) < 2e-3


def test_half_and_float64_inputs_via_forward(layer):
    x, ids, w = inputs(3)
    ref = layer.forward(x, ids, w)
    out = layer.forward(x.half(), ids.int(), w.double())
    assert out.dtype == torch.float32 and rel_error(out, ref) < 0.04  # fp16 input re-rolls the int8 rounding


def test_forced_isa_missing_is_a_clear_error(weights, pool, monkeypatch):
    missing = [isa for isa in native.ISAS if native.isa_missing(isa)]
    if not missing:
        pytest.skip("this CPU has every ISA path")
    monkeypatch.setenv("HYBRIDMOE_CPU_ISA", missing[-1])
    with pytest.raises(native.CpuIsaError, match="cannot run here"):
        CPUMoELayer(pack_layer(*weights, "BF16"), pool=pool)
    with pytest.raises(native.CpuIsaError, match="unknown"):
        native.resolve_isa("sse2")


def test_env_forces_available_isa(weights, pool, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_CPU_ISA", "avx2")
    assert CPUMoELayer(pack_layer(*weights, "BF16"), pool=pool).kernel_name == "avx2"


def test_host_function_entry_points(layer, pool):
    lb = native.lib()
    x, ids, w = inputs(6)
    out = torch.zeros(6, H)
    task, keep = layer.make_task(x, ids, w, out)
    call = native.HostCall(pool.handle, task, 0, 0, -1, 0)
    hostfn = C.CFUNCTYPE(None, C.c_void_p)
    submit_addr, sync_addr = native.host_functions()
    hostfn(submit_addr)(C.addressof(call))  # what cuLaunchHostFunc would do
    assert call.id > 0
    hostfn(sync_addr)(C.addressof(call))
    assert call.status == 0
    assert torch.allclose(out, layer.forward(x, ids, w), atol=1e-6)
    bad = ids.clone()
    bad[0, 0] = 99
    task, keep = layer.make_task(x, bad, w, out)
    call = native.HostCall(pool.handle, task, 0, 0, -1, 0)
    lb.hm_submit_hostfn(C.addressof(call))
    lb.hm_sync_hostfn(C.addressof(call))
    assert call.status == 1
    with pytest.raises(CPUMoEError):  # the error also reaches the next Python sync
        pool.sync()


def test_pair_host_function_entry_points(layer, pool):
    """One host function for two calls: submit both (in order), wait for both, each call's status
    its own (the hybrid layer's immediate + deferred tasks, and a result wait that also collects the
    previous layer's deferred task)."""
    x, ids, w = inputs(5)
    later_ids = ids.flip(1).contiguous()
    outs = [torch.zeros(5, H), torch.zeros(5, H)]
    tasks = [layer.make_task(x, i, w, o) for i, o in zip((ids, later_ids), outs)]
    calls = [native.HostCall(pool.handle, t, 0, 0, -1, 0) for t, _ in tasks]
    pair = native.HostCallPair(C.pointer(calls[0]), C.pointer(calls[1]))
    hostfn = C.CFUNCTYPE(None, C.c_void_p)
    submit2, sync2 = native.pair_host_functions()
    hostfn(submit2)(C.addressof(pair))
    assert 0 < calls[0].id < calls[1].id  # submitted in order
    hostfn(sync2)(C.addressof(pair))
    assert calls[0].status == calls[1].status == 0
    assert torch.allclose(outs[0], layer.forward(x, ids, w), atol=1e-6)
    assert torch.allclose(outs[1], layer.forward(x, later_ids, w), atol=1e-6)
    bad = ids.clone()
    bad[1, 1] = 99  # the second call fails, the first not
    tasks[1] = layer.make_task(x, bad, w, outs[1])
    calls[1] = native.HostCall(pool.handle, tasks[1][0], 0, 0, -1, 0)
    pair = native.HostCallPair(C.pointer(calls[0]), C.pointer(calls[1]))
    hostfn(submit2)(C.addressof(pair))
    hostfn(sync2)(C.addressof(pair))
    assert calls[0].status == 0 and calls[1].status == 1
    with pytest.raises(CPUMoEError):  # the error also reaches the next Python sync
        pool.sync()
    assert torch.allclose(outs[0], layer.forward(x, ids, w), atol=1e-6)  # the pool runs on


def test_stream_read(pool):
    assert pool.stream_read_gbps(16 << 20, 2) > 0.1


def test_cpu_backend_registered(weights):
    from hybridmoe.moe import cpu_experts
    from hybridmoe.moe.experts import _BACKENDS, ExpertWeights

    assert _BACKENDS["cpu"] is cpu_experts.make_cpu_experts
    ew = ExpertWeights(weights[0].bfloat16(), weights[1].bfloat16())
    be = cpu_experts.make_cpu_experts(ew, 0, {"kt_method": "AMXINT4", "kt_cpuinfer": 2, "group_size": 64})
    x, ids, w = inputs(4)
    y = be.forward(x.bfloat16(), ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == (4, H)
    ref = moe_reference(x, ids, w, weights[0].bfloat16().float(), weights[1].bfloat16().float())
    assert rel_error(y.float(), ref) < 0.3


def test_subpools_and_numa_binding(weights):
    from hybridmoe.cpu.engine import CPUThreadPool

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


@pytest.mark.parametrize("spin_us", ["0", "5000"])
def test_many_tasks_sleeping_and_spinning_pool(weights, monkeypatch, spin_us):
    """Hundreds of small tasks through a pool whose threads sleep between phases (spin 0) or spin:
    in-order accumulation must come out exact."""
    from hybridmoe.cpu.engine import CPUThreadPool

    monkeypatch.setenv("HYBRIDMOE_CPU_SPIN_US", spin_us)
    pool3 = CPUThreadPool(threads=3)
    try:
        lay = CPUMoELayer(pack_layer(*weights, "AMXINT8"), pool=pool3)
        x, ids, w = inputs(3, 5)
        one = lay.forward(x, ids, w)
        out = torch.zeros(3, H)
        for j in range(150):
            lay.submit(x, ids, w, out, accumulate=j > 0)
            if j % 50 == 49:
                lay.sync(max_pending=3)
        lay.sync()
        assert torch.allclose(out, one * 150, rtol=1e-4, atol=1e-4)
        del lay
    finally:
        pool3.close()


def test_numa_nodes_option():
    """--kt-numa-nodes: the pool's cores come from the listed nodes, one sub-pool per node at least;
    a node the machine lacks is a clear error, at config validation and when a pool is built."""
    from hybridmoe.config import ConfigError, EngineArgs
    from hybridmoe.cpu.engine import CPUThreadPool
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


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_prefetch_distance_changes_nothing_but_speed(method):
    """The few-row kernels' software prefetch (hm_set_prefetch, HYBRIDMOE_CPU_PREFETCH) reads ahead
    of, and past the end of, the weights: results are bit-identical to no prefetch."""
    g = torch.Generator().manual_seed(5)
    e, h, i, k, t = 6, 128, 64, 3, 5
    gu, dn = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    layer = CPUMoELayer(pack_layer(gu, dn, method, group_size=64))
    x = torch.randn(t, h, generator=g)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(t, k, generator=g)
    lib = native.lib()
    before = lib.hm_get_prefetch()
    try:
        outs = []
        for pf in (0, 256, 4096, 1 << 20):
            lib.hm_set_prefetch(pf)
            assert lib.hm_get_prefetch() == pf
            outs.append(layer.forward(x, ids, w))
    finally:
        lib.hm_set_prefetch(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_item_size_changes_nothing_but_speed(method):
    """The few-row GEMM item size (hm_set_item_bytes, HYBRIDMOE_CPU_ITEM_KB) and the guided claiming
    (hm_set_guided, HYBRIDMOE_CPU_GUIDED) only change how the N-blocks are cut among the threads: results are bit-identical for every size, for tasks that
    use it (few rows per expert) and tasks that do not (an expert with >= 64 rows)."""
    g = torch.Generator().manual_seed(7)
    e, h, i, k = 6, 192, 96, 3
    gu, dn = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    # 3 threads on 2 cores: claims race, and a guided run ends in single-item claims
    layer = CPUMoELayer(pack_layer(gu, dn, method, group_size=64), pool=CPUThreadPool(threads=3))
    lib = native.lib()
    before = lib.hm_get_item_bytes(), lib.hm_get_guided()
    try:
        for t in (1, 5, 90):
            x = torch.randn(t, h, generator=g)
            ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
            w = torch.rand(t, k, generator=g)
            outs = []
            # fixed widths, 1 block, a few, all of them; claims of one item, or guided runs
            for size, guided in itertools.product((0, 1, 3000, 64 << 10, 1 << 30), (0, 1, 3)):
                lib.hm_set_item_bytes(size)
                lib.hm_set_guided(guided)
                assert (lib.hm_get_item_bytes(), lib.hm_get_guided()) == (size, guided)
                outs.append(layer.forward(x, ids, w))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), t
            aq = "int8" if method != "BF16" else None  # fp32 x: BF16 keeps fp32 activations
            ref = moe_reference(x, ids, w, *layer.packed.dequantized(), act_quant=aq)
            assert rel_error(outs[0], ref) < 2e-3, t
    finally:
        lib.hm_set_item_bytes(before[0])
        lib.hm_set_guided(before[1])


def test_trace_decomposes_the_time_between_tasks(layer, pool):
    """A stream emulated in Python: submit host function, "GPU work" (sleep), wait host function,
    more "GPU work" before the next layer's submit. The trace sees every task's submit, start, end
    and wait, and the summary puts the sleeps where they belong: the pool waits for the next submit
    (>= the 3 ms after each wait) and the next submit comes >= 3 ms after a wait returns."""
    from hybridmoe.cpu.trace import format_summary, summarize, task_times

    lb = native.lib()
    x, ids, w = inputs(3)
    out = torch.zeros(3, H)
    task, keep = layer.make_task(x, ids, w, out)
    pool.sync()
    pool.trace_start(1000)
    first = None
    for _ in range(5):
        call = native.HostCall(pool.handle, task, 0, 0, -1, 0)
        lb.hm_submit_hostfn(C.addressof(call))
        first = first or call.id
        time.sleep(0.001)
        lb.hm_sync_hostfn(C.addressof(call))
        time.sleep(0.003)
    ev = pool.trace_stop()
    tt = task_times(ev)
    assert sorted(tt) == list(range(first, first + 5))
    for v in tt.values():  # every event once, in causal order
        assert v["submit"] <= v["start"] <= v["end"] <= v["sync_exit"] and v["sync_enter"] <= v["sync_exit"]
    s = summarize(ev)
    assert s["tasks"] == 5 and s["waits"] == 5 and s["releases"] == 4, s  # the last release has no next submit
    assert s["gpu_path_us"] >= 3000 and s["wait_submit_us"] >= 3000, s
    assert 0 < s["run_us"] and s["run_total_ms"] < s["wall_ms"] and s["wake_us"] >= 0 and s["start_latency_us"] >= 0, s
    assert s["idle_total_ms"] >= 4 * 3.0 and s["blocked_us"] <= 1000 + s["run_us"] + 500, s
    assert "5 tasks" in format_summary(s)
    pool.trace_start(2)  # capacity: later events are dropped, and counted
    pool.sync(pool.submit(*layer.make_task(x, ids, w, out)))
    assert pool.trace_stop().shape == (2, 3)


@pytest.mark.parametrize("spin_us", [0, 50])
def test_host_function_wait_that_sleeps(layer, pool, spin_us):
    """hm_set_hostfn_spin_us: a host function's wait spins that long, then sleeps until the pool
    wakes it; the task's result and status are the same, for tasks that end before and after the
    wait begins."""
    lb = native.lib()
    before = lb.hm_get_hostfn_spin_us()
    lb.hm_set_hostfn_spin_us(spin_us)
    try:
        assert lb.hm_get_hostfn_spin_us() == spin_us
        for t in (1, 40, 300):  # short and longer tasks
            x, ids, w = inputs(t, seed=t)
            out = torch.zeros(t, H)
            task, keep = layer.make_task(x, ids, w, out)
            call = native.HostCall(pool.handle, task, 0, 0, -1, 0)
            lb.hm_submit_hostfn(C.addressof(call))
            lb.hm_sync_hostfn(C.addressof(call))
            assert call.status == 0 and pool.pending() == 0
            assert torch.allclose(out, layer.forward(x, ids, w), atol=1e-6)
    finally:
        lb.hm_set_hostfn_spin_us(before)
    assert lb.hm_get_hostfn_spin_us() == before


def test_gated_submit_waits_for_its_go_word(layer, pool):
    """hm_submit_gated: the task is queued at once but starts only when its go word is set (by the
    stream's copy on CUDA; here by hand), clears the word, and gives the ungated result; a task
    queued behind it ungated (a deferred task) waits its turn; the trace counts a gated task as
    submitted when it was released."""
    from hybridmoe.cpu.trace import task_times

    lb = native.lib()
    x, ids, w = inputs(5, seed=3)
    outs = [torch.zeros(5, H), torch.zeros(5, H)]
    tasks = [layer.make_task(x, ids, w, o) for o in outs]
    calls = [native.HostCall(pool.handle, t, 0, 0, -1, 0) for t, _ in tasks]
    go = torch.zeros(1, dtype=torch.int32)
    pool.sync()
    pool.trace_start(100)
    lb.hm_submit_gated(C.byref(calls[0]), go.data_ptr())
    lb.hm_submit_gated(C.byref(calls[1]), None)
    assert calls[1].id == calls[0].id + 1
    time.sleep(0.05)
    assert pool.pending() == 2 and not outs[0].any() and not outs[1].any()  # neither ran: the gate is shut
    t_go = time.monotonic_ns()
    go[0] = 1
    lb.hm_sync_hostfn(C.addressof(calls[1]))
    ev = pool.trace_stop()
    assert calls[1].status == 0 and pool.pending() == 0 and go.item() == 0
    want = layer.forward(x, ids, w)
    assert torch.allclose(outs[0], want, atol=1e-6) and torch.allclose(outs[1], want, atol=1e-6)
    tt = task_times(ev)[calls[0].id]
    assert tt["submit"] >= t_go and tt["start"] >= tt["submit"]  # (steady clock = CLOCK_MONOTONIC)


def test_gated_task_that_is_never_released_fails_after_the_timeout(tmp_path):
    """A gated task whose go word never comes (a graph launch that failed) is skipped after
    HYBRIDMOE_CPU_GATE_TIMEOUT_S with an error that says so; the pool serves the next task."""
    import subprocess
    import sys

    script = tmp_path / "gate.py"
    script.write_text(
        "import ctypes as C, torch\n"
        "from hybridmoe.cpu import native\n"
        "from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool\n"
        "from hybridmoe.cpu.quant import pack_layer\n"
        "g = torch.Generator().manual_seed(0)\n"
        "gu, dn = torch.randn(4, 128, 64, generator=g) / 8, torch.randn(4, 64, 64, generator=g) / 8\n"
        "pool = CPUThreadPool(threads=1)\n"
        "layer = CPUMoELayer(pack_layer(gu, dn, 'BF16'), pool=pool)\n"
        "x, ids, w = torch.randn(2, 64, generator=g), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2, generator=g)\n"
        "out = torch.zeros(2, 64)\n"
        "task, keep = layer.make_task(x, ids, w, out)\n"
        "call = native.HostCall(pool.handle, task, 0, 0, -1, 0)\n"
        "go = torch.zeros(1, dtype=torch.int32)\n"
        "native.lib().hm_submit_gated(C.byref(call), go.data_ptr())\n"
        "try:\n"
        "    pool.sync()\n"
        "except CPUMoEError as e:\n"
        "    print('ERROR', e)\n"
        "assert not out.any()\n"
        "print('NEXT', torch.allclose(layer.forward(x, ids, w), layer.forward(x, ids, w)))\n")
    env = {**__import__("os").environ, "HYBRIDMOE_CPU_GATE_TIMEOUT_S": "0.3"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERROR" in r.stdout and "did not release it within HYBRIDMOE_CPU_GATE_TIMEOUT_S" in r.stdout, r.stdout
    assert "NEXT True" in r.stdout and time.monotonic() - t0 < 60


def test_submit_program_queues_recorded_gated_submits_in_order(layer, pool):
    """cuda_bridge.record_submits / SubmitProgram (what a captured decode graph replays): the
    recorded submits are queued in capture order by one call each time, each gated on its own word
    (or none), and run as often as the program is submitted."""
    from hybridmoe.moe import cuda_bridge

    x, ids, w = inputs(4, seed=5)
    outs = [torch.zeros(4, H) for _ in range(3)]
    calls = [native.HostCall(pool.handle, layer.make_task(x, ids, w, o, accumulate=True)[0], 0, 0, -1, 0)
             for o in outs]
    gos = [torch.zeros(1, dtype=torch.int32), None, torch.zeros(1, dtype=torch.int32)]
    with cuda_bridge.record_submits() as rec:
        for c, g in zip(calls, gos):
            cuda_bridge._gated_submit(c, g)
        with pytest.raises(RuntimeError, match="already active"):
            with cuda_bridge.record_submits():
                pass
    assert pool.pending() == 0 and len(rec) == 3  # recorded, not queued
    program = cuda_bridge.SubmitProgram(rec)
    want = layer.forward(x, ids, w)
    for rep in (1, 2):
        pool.sync()
        program.submit()
        ids_now = [c.id for c in calls]
        assert ids_now == list(range(ids_now[0], ids_now[0] + 3))
        time.sleep(0.02)
        assert pool.pending() == 3  # the first one's gate is shut: nothing behind it runs
        gos[0][0] = 1
        deadline = time.monotonic() + 30
        while pool.pending() > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)
        assert pool.pending() == 1  # the second was not gated, the third waits for its word
        gos[2][0] = 1
        pool.sync()
        for o in outs:  # accumulate=True: each submission adds one more result
            assert torch.allclose(o, rep * want, atol=1e-5)


def test_host_call_waits_pair_with_submits_in_order(layer, pool):
    """A HostCall submitted again before the stream waited for its previous task (a gated submit
    runs on the host thread, ahead of the stream: the next forward's task) keeps both ids: each
    hm_sync_hostfn waits for the oldest one, not the newest (that one waits for a go word the
    stream writes only after this wait: a deadlock). Past 8 ids waiting, a submit blocks until a
    wait takes one."""
    import threading

    lb = native.lib()
    x, ids, w = inputs(3, seed=11)
    out = torch.zeros(3, H)
    call = native.HostCall(pool.handle, layer.make_task(x, ids, w, out)[0], 0, 0, -1, 0)
    go = torch.zeros(1, dtype=torch.int32)
    pool.sync()
    lb.hm_submit_gated(C.byref(call), go.data_ptr())
    first = call.id
    lb.hm_submit_gated(C.byref(call), go.data_ptr())
    assert call.id == first + 1 and call.tail - call.head == 2
    go[0] = 1
    waiter = threading.Thread(target=lb.hm_sync_hostfn, args=(C.addressof(call),), daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "the wait took the newest id"
    assert pool.pending() == 1 and call.tail - call.head == 1  # the second task still waits for its go word
    deadline = time.monotonic() + 30
    while go.item() and time.monotonic() < deadline:  # the first task clears it before it runs
        time.sleep(0.001)
    go[0] = 1
    lb.hm_sync_hostfn(C.addressof(call))
    assert pool.pending() == 0 and call.head == call.tail and call.status == 0
    assert torch.allclose(out, layer.forward(x, ids, w), atol=1e-6)
    for _ in range(8):  # ungated: they run at once; their ids wait for the stream's waits
        lb.hm_submit_gated(C.byref(call), None)
    ninth = threading.Thread(target=lb.hm_submit_gated, args=(C.byref(call), None), daemon=True)
    ninth.start()
    time.sleep(0.05)
    assert ninth.is_alive() and call.tail - call.head == 8  # blocked: the ring is full
    lb.hm_sync_hostfn(C.addressof(call))
    ninth.join(30)
    assert not ninth.is_alive() and call.tail - call.head == 8
    for _ in range(8):
        lb.hm_sync_hostfn(C.addressof(call))
    assert call.head == call.tail and pool.pending() == 0
