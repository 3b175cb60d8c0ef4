"""Where the CPU expert engine's time goes between tasks, from its trace events
(CPUThreadPool.trace_start / trace_stop).

Per task: `run` (start -> end), `idle_before` (the pool idle between the previous task's end and
this start), split into `wait_submit` (the pool had nothing to do: the task was not submitted yet,
i.e. the GPU side had not reached its submit host function) and `start_latency` (submitted, or the
previous task done, whichever was later -> started: queue hand-over and thread wake-up). Per host
function wait on a task: `wake` (task end -> the wait returned: what the stream loses after the
CPU is done) and `gpu_path` (that return -> the next task's submit: the GPU work and host-function
launches between one layer's CPU result and the next layer's CPU task).
"""

from __future__ import annotations

import statistics

import torch

KINDS = {"submit": 0, "start": 1, "end": 2, "sync_enter": 3, "sync_exit": 4}


def task_times(events: torch.Tensor) -> dict[int, dict[str, int]]:
    """{task id: {kind name: t_ns}} (the first event of each kind; host-function waits on "any
    pending" (id <= 0) are left out)."""
    names = {v: k for k, v in KINDS.items()}
    out: dict[int, dict[str, int]] = {}
    for t_ns, tid, kind in events.tolist():
        if tid <= 0 or kind not in names:
            continue
        out.setdefault(int(tid), {}).setdefault(names[kind], int(t_ns))
    return out


def summarize(events: torch.Tensor) -> dict[str, float]:
    """Means in microseconds over the traced tasks (see the module docstring), the task count and
    the traced wall time. Tasks missing an event (cut off by the capacity) are skipped."""
    tt = task_times(events)
    ids = sorted(i for i, v in tt.items() if {"submit", "start", "end"} <= v.keys())
    run, idle, wait_sub, lat, wake, gpu = [], [], [], [], [], []
    for a, b in zip(ids, ids[1:]):
        if b != a + 1:
            continue
        pa, pb = tt[a], tt[b]
        if a == ids[0]:
            run.append(pa["end"] - pa["start"])
        run.append(pb["end"] - pb["start"])
        idle.append(max(0, pb["start"] - pa["end"]))
        wait_sub.append(max(0, pb["submit"] - pa["end"]))
        lat.append(max(0, pb["start"] - max(pb["submit"], pa["end"])))
        if "sync_exit" in pa:
            wake.append(max(0, pa["sync_exit"] - pa["end"]))
            gpu.append(max(0, pb["submit"] - pa["sync_exit"]))

    def mean_us(v: list[int]) -> float:
        return statistics.fmean(v) / 1e3 if v else float("nan")

    wall = (tt[ids[-1]]["end"] - tt[ids[0]]["submit"]) / 1e3 if ids else 0.0
    return {
        "tasks": float(len(ids)),
        "wall_us": wall,
        "run_us": mean_us(run),
        "idle_before_us": mean_us(idle),
        "wait_submit_us": mean_us(wait_sub),
        "start_latency_us": mean_us(lat),
        "wake_us": mean_us(wake),
        "gpu_path_us": mean_us(gpu),
        "waited_tasks": float(len(wake)),
    }


def format_summary(s: dict[str, float]) -> str:
    """One line for logs."""
    return (
        f"{int(s['tasks'])} tasks: run {s['run_us']:.1f} us, pool idle before a task {s['idle_before_us']:.1f} us "
        f"(nothing submitted {s['wait_submit_us']:.1f}, start latency {s['start_latency_us']:.1f}); "
        f"host-function wait returns {s['wake_us']:.1f} us after the task ends, next submit "
        f"{s['gpu_path_us']:.1f} us after that ({int(s['waited_tasks'])} waits)"
    )
