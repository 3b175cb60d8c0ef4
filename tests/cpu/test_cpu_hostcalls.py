"""The CUDA-stream side of the CPU engine without a GPU: the wait host functions (hm_sync_hostfn,
hm_sync2_hostfn) called as cuLaunchHostFunc would call them, gated submits (queued at once,
started by a go word the stream writes; here written by hand), the recorded submit programs a
captured graph replays, and the trace of all of it."""

import ctypes as C
import threading
import time

import pytest
import torch

from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.settings import CPUEngineSettings

HOSTFN = C.CFUNCTYPE(None, C.c_void_p)  # CUhostFn: void fn(void* userdata)


def _call(pool, layer, x, ids, w, out) -> native.HostCall:
    return native.HostCall(pool.handle, layer.make_task(x, ids, w, out)[0], 0, 0, -1, 0)


def _submit(call: native.HostCall, go: torch.Tensor | None = None) -> None:
    native.lib().hm_submit_gated(C.byref(call), None if go is None else go.data_ptr())


def test_retired_entry_points_are_gone():
    """ABI 9: tasks start only by gated submits (no submit host functions), and the item size,
    guided claiming, prefetch and host-function spin are pool settings, not run-time setters.
    (ABI 10 adds the FP8 method: method 3 in LayerDesc, structs unchanged; ABI 11 the load-time
    quantizer hm_quantize; ABI 12 the GGUF layer hm_gguf_layer_create; ABI 13 expert LoRA: HmTask.lora_idx,
    HmLayer.lora, hm_layer_attach_lora; ABI 15 the native routing hm_topk_softmax and HmLayerDecode.moe; ABI 16
    the stacked decoder layers hm_layers_decode; ABI 19 the AVX-512 decode attention span, hm_attn_kernel; ABI 20
    HmTask.nan_rows, in the struct's former padding; ABI 21 hm_pool_reduce_inline; ABI 22 hm_amx_emulated; ABI 23
    hm_pool_fused_reduce; ABI 24 hm_pool_fuse in its place; ABI 25 hm_pool_block_prefetch; ABI 26 HmHostCall.done, HmTask.ids2 / out2 / done1.)"""
    lb = native.lib()
    assert lb.hm_abi_version() == native.ABI_VERSION == 26
    for name in ("hm_submit_hostfn", "hm_submit2_hostfn", "hm_set_item_bytes", "hm_set_guided", "hm_set_prefetch",
                 "hm_set_hostfn_spin_us"):
        assert not hasattr(lb, name), name


def test_host_function_entry_points(layer, pool, inputs):
    """A submitted task waited for by the hm_sync_hostfn entry point (its address, called as the
    driver would): status 0 and the task's result; a failing task: status 1, and its error also
    reaches the next Python sync."""
    x, ids, w = inputs(6)
    out = torch.zeros_like(x)
    sync_addr, _ = native.wait_host_functions()
    call = _call(pool, layer, x, ids, w, out)
    _submit(call)
    assert call.id > 0
    HOSTFN(sync_addr)(C.addressof(call))
    assert call.status == 0 and call.head == call.tail
    assert torch.allclose(out, layer.forward(x, ids, w), atol=1e-6)
    bad = ids.clone()
    bad[0, 0] = 99
    call = _call(pool, layer, x, bad, w, out)
    _submit(call)
    HOSTFN(sync_addr)(C.addressof(call))
    assert call.status == 1
    with pytest.raises(CPUMoEError):  # the error also reaches the next Python sync
        pool.sync()


def test_pair_host_function_entry_points(layer, pool, inputs):
    """One host function waits for two calls (a layer's task and the previous layer's deferred
    one), each call's status its own."""
    x, ids, w = inputs(5)
    later_ids = ids.flip(1).contiguous()
    outs = [torch.zeros_like(x), torch.zeros_like(x)]
    calls = [_call(pool, layer, x, i, w, o) for i, o in zip((ids, later_ids), outs)]
    pair = native.HostCallPair(C.pointer(calls[0]), C.pointer(calls[1]))
    _, sync2 = native.wait_host_functions()
    for c in calls:
        _submit(c)
    assert 0 < calls[0].id < calls[1].id  # submitted in order
    HOSTFN(sync2)(C.addressof(pair))
    assert calls[0].status == calls[1].status == 0
    assert torch.allclose(outs[0], layer.forward(x, ids, w), atol=1e-6)
    assert torch.allclose(outs[1], layer.forward(x, later_ids, w), atol=1e-6)
    bad = ids.clone()
    bad[1, 1] = 99  # the second call fails, the first not
    calls[1] = _call(pool, layer, x, bad, w, outs[1])
    pair = native.HostCallPair(C.pointer(calls[0]), C.pointer(calls[1]))
    for c in calls:
        _submit(c)
    HOSTFN(sync2)(C.addressof(pair))
    assert calls[0].status == 0 and calls[1].status == 1
    with pytest.raises(CPUMoEError):  # the error also reaches the next Python sync
        pool.sync()
    assert torch.allclose(outs[0], layer.forward(x, ids, w), atol=1e-6)  # the pool runs on


def test_trace_decomposes_the_time_between_tasks(layer, pool, inputs):
    """A stream emulated in Python: submit, "GPU work" (sleep), wait host function, more "GPU
    work" before the next layer's submit. The trace sees every task's submit, start, end and wait,
    and the summary puts the sleeps where they belong: the pool waits for the next submit (>= the
    3 ms after each wait) and the next submit comes >= 3 ms after a wait returns."""
    from hybridmoe.cpu.trace import format_summary, summarize, task_times

    lb = native.lib()
    x, ids, w = inputs(3)
    out = torch.zeros_like(x)
    task, keep = layer.make_task(x, ids, w, out)
    pool.sync()
    pool.trace_start(1000)
    first = None
    for _ in range(5):
        call = native.HostCall(pool.handle, task, 0, 0, -1, 0)
        _submit(call)
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
    # a layer's period: >= the 1 + 3 ms of sleep between releases, and the task's run on top
    assert 4000 <= s["release_interval_us"] <= 4000 + s["run_us"] + 20000, s
    assert 0 < s["run_us"] and s["run_total_ms"] < s["wall_ms"] and s["wake_us"] >= 0 and s["start_latency_us"] >= 0, s
    assert s["idle_total_ms"] >= 4 * 3.0 and s["blocked_us"] <= 1000 + s["run_us"] + 500, s
    assert "5 tasks" in format_summary(s) and "5 stream waits" in format_summary(s)
    # a stream waiting by memory operations runs no host function: the line says so instead of nan
    quiet = dict(s, waits=0.0, releases=0.0, blocked_us=float("nan"), wake_us=float("nan"), gpu_path_us=float("nan"))
    assert "no host-function waits" in format_summary(quiet) and "nan" not in format_summary(quiet)
    pool.trace_start(2)  # capacity: later events are dropped, and counted
    pool.sync(pool.submit(*layer.make_task(x, ids, w, out)))
    assert pool.trace_stop().shape == (2, 3)


@pytest.mark.parametrize("spin_us", [0, 50, -1])
def test_host_function_wait_that_sleeps(layer, inputs, spin_us):
    """CPUEngineSettings.hostfn_spin_us (-1: the pool's idle spin): a host function's wait spins
    that long, then sleeps until the pool wakes it; the task's result and status are the same, for
    tasks that end before and after the wait begins."""
    lb = native.lib()
    pool = CPUThreadPool(threads=2, settings=CPUEngineSettings(hostfn_spin_us=spin_us, spin_us=200))
    try:
        assert pool.native_settings().hostfn_spin_us == spin_us
        lay = CPUMoELayer(layer.packed, pool=pool)
        for t in (1, 40, 300):  # short and longer tasks
            x, ids, w = inputs(t, seed=t)
            out = torch.zeros_like(x)
            call = _call(pool, lay, x, ids, w, out)
            _submit(call)
            lb.hm_sync_hostfn(C.addressof(call))
            assert call.status == 0 and pool.pending() == 0
            assert torch.allclose(out, lay.forward(x, ids, w), atol=1e-6)
        del lay
    finally:
        pool.close()


def test_gated_submit_waits_for_its_go_word(layer, pool, inputs):
    """hm_submit_gated: the task is queued at once but starts only when its go word is set (by the
    stream's copy on CUDA; here by hand), clears the word, and gives the ungated result; a task
    queued behind it ungated (a deferred task) waits its turn; the trace counts a gated task as
    submitted when it was released."""
    from hybridmoe.cpu.trace import task_times

    lb = native.lib()
    x, ids, w = inputs(5, seed=3)
    outs = [torch.zeros_like(x), torch.zeros_like(x)]
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


def test_submit_program_queues_recorded_gated_submits_in_order(layer, pool, inputs):
    """cuda_bridge.GatedSubmitter.recording / SubmitProgram (what a captured decode graph replays): the
    recorded submits are queued in capture order by one call each time, each gated on its own word
    (or none), and run as often as the program is submitted."""
    from hybridmoe.moe import cuda_bridge

    x, ids, w = inputs(4, seed=5)
    outs = [torch.zeros_like(x) for _ in range(3)]
    calls = [native.HostCall(pool.handle, layer.make_task(x, ids, w, o, accumulate=True)[0], 0, 0, -1, 0)
             for o in outs]
    gos = [torch.zeros(1, dtype=torch.int32), None, torch.zeros(1, dtype=torch.int32)]
    submitter = cuda_bridge.GatedSubmitter()
    with submitter.recording() as rec:
        for c, g in zip(calls, gos):
            submitter.submit(c, g)
        with pytest.raises(RuntimeError, match="already active"):
            with submitter.recording():
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


def test_host_call_waits_pair_with_submits_in_order(layer, pool, inputs):
    """A HostCall submitted again before the stream waited for its previous task (a gated submit
    runs on the host thread, ahead of the stream: the next forward's task) keeps both ids: each
    hm_sync_hostfn waits for the oldest one, not the newest (that one waits for a go word the
    stream writes only after this wait: a deadlock). Past 8 ids waiting, a submit blocks until a
    wait takes one."""
    lb = native.lib()
    x, ids, w = inputs(3, seed=11)
    out = torch.zeros_like(x)
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


def test_gated_task_that_is_never_released_fails_after_the_timeout(layer, inputs):
    """A gated task whose go word never comes (a graph launch that failed) is skipped after the
    pool's CPUEngineSettings.gate_timeout_s with an error that says so; the pool serves the next
    task."""
    pool = CPUThreadPool(threads=1, settings=CPUEngineSettings(gate_timeout_s=0.3))
    try:
        lay = CPUMoELayer(layer.packed, pool=pool)
        x, ids, w = inputs(2, seed=4)
        out = torch.zeros_like(x)
        call = _call(pool, lay, x, ids, w, out)
        go = torch.zeros(1, dtype=torch.int32)
        t0 = time.monotonic()
        _submit(call, go)
        with pytest.raises(CPUMoEError, match=r"did not release it within the gate timeout .*gate_timeout_s = 0.3 s"):
            pool.sync()
        assert 0.25 < time.monotonic() - t0 < 30 and not out.any()
        assert torch.equal(lay.forward(x, ids, w), layer.forward(x, ids, w))
        del lay
    finally:
        pool.close()


def _wait_word(word: torch.Tensor, value: int, timeout_s: float = 30) -> bool:
    """What cuStreamWaitValue32 does on the GPU, by polling: True once word == value."""
    deadline = time.monotonic() + timeout_s
    while word.item() != value:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def test_done_word_is_set_on_every_way_out(layer, inputs):
    """HmHostCall.done (the stream's memory-operation wait): the pool sets it to 1 once the task's
    output is written, and also when the task fails or is skipped at the gate timeout (a stream
    polling for it must never hang); such a call's ids are not queued for hm_sync_hostfn, so more
    than the ring's 8 submits ahead of the stream never block the host thread."""
    pool = CPUThreadPool(threads=1, settings=CPUEngineSettings(gate_timeout_s=0.3))
    try:
        lay = CPUMoELayer(layer.packed, pool=pool)
        x, ids, w = inputs(5, seed=21)
        out = torch.zeros_like(x)
        done = torch.zeros(1, dtype=torch.int32)
        call = native.HostCall(pool.handle, lay.make_task(x, ids, w, out)[0], 0, 0, -1, 0, done=done.data_ptr())
        go = torch.zeros(1, dtype=torch.int32)
        _submit(call, go)
        time.sleep(0.05)
        assert done.item() == 0 and not out.any() and call.id > 0 and call.head == call.tail == 0
        go[0] = 1
        assert _wait_word(done, 1)
        assert torch.allclose(out, layer.forward(x, ids, w), atol=1e-6)  # written before the word
        done[0] = 0  # the stream's reset (cuStreamWriteValue32)
        bad = ids.clone()
        bad[2, 1] = 99  # fails: the word is still set, the error reaches the next sync
        call = native.HostCall(pool.handle, lay.make_task(x, bad, w, out)[0], 0, 0, -1, 0, done=done.data_ptr())
        _submit(call)
        assert _wait_word(done, 1)
        with pytest.raises(CPUMoEError, match="out of range"):
            pool.sync()
        done[0] = 0
        go[0] = 0
        _submit(call, go)  # never released: skipped after the gate timeout, the word set all the same
        assert _wait_word(done, 1)
        with pytest.raises(CPUMoEError, match="gate timeout"):
            pool.sync()
        done[0] = 0
        good = native.HostCall(pool.handle, lay.make_task(x, ids, w, out)[0], 0, 0, -1, 0, done=done.data_ptr())
        t0 = time.monotonic()
        for _ in range(12):  # no ring: twelve ungated submits return at once
            _submit(good)
        assert time.monotonic() - t0 < 5 and good.head == good.tail == 0
        pool.sync()
        assert done.item() == 1
        del lay
    finally:
        pool.close()


def test_first_group_done_word_is_set_once():
    """HmTask.done1 (a one-token layer's task merged with its deferred pairs, cuda_bridge merge): the pool sets it
    once the first group's output is written, and the stream waits for it and clears it while the second group
    runs. It must not be set again when the task ends: a 1 left there let the stream's wait in the next decode
    step pass before that step's output was written (session 32; the end-of-task mark had set it again). Here
    the stream is this thread, polling the word and clearing it as soon as it sees it, until the task's own done
    word is set; the second group (seven pairs) takes milliseconds, so the clear comes before the task ends.
    Also when the task fails (an id out of range) or is skipped at the gate: done1 is then set by the end mark,
    once."""
    from hybridmoe.cpu.pack import pack_layer

    g = torch.Generator().manual_seed(5)
    e, h, i = 16, 1024, 768
    packed = pack_layer(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05,
                        "AMXINT8")
    pool = CPUThreadPool(threads=2, settings=CPUEngineSettings(gate_timeout_s=0.3))
    try:
        lay = CPUMoELayer(packed, pool=pool)
        x = torch.randn(1, h, generator=g).to(torch.bfloat16)
        ids = torch.randperm(e, generator=g)[:8].to(torch.int32).view(1, 8)
        w = torch.rand(1, 8, generator=g)
        ids1, ids2 = ids.clone(), ids.clone()
        ids1[0, 1:] = -1  # group 0: one pair
        ids2[0, 0] = -1  # group 1: seven pairs
        for case in ("ok", "fails", "skipped"):
            outs = [torch.zeros(1, h), torch.zeros(1, h)]
            done1, done = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            first = ids1.clone()
            if case == "fails":
                first[0, 0] = 99
            task, keep = lay.make_task(x, first, w, outs[0], ids2=ids2, out2=outs[1], done1=done1)
            call = native.HostCall(pool.handle, task, 0, 0, -1, 0, done=done.data_ptr())
            go = torch.zeros(1, dtype=torch.int32)
            _submit(call, go)
            if case != "skipped":
                go[0] = 1
            seen, deadline = 0, time.monotonic() + 30
            while True:
                if done1.item() == 1:
                    seen += 1
                    done1[0] = 0  # the stream's clear after its wait
                if done.item() == 1:  # the end mark sets done1 (if at all) before done: one last look
                    if done1.item() == 1:
                        seen += 1
                        done1[0] = 0
                    break
                assert time.monotonic() < deadline, case
            assert seen == 1, (case, seen)
            if case == "ok":
                assert outs[0].ne(0).any() and outs[1].ne(0).any()
                pool.sync()
            else:
                with pytest.raises(CPUMoEError, match="out of range" if case == "fails" else "gate timeout"):
                    pool.sync()
            del keep
        del lay
    finally:
        pool.close()
