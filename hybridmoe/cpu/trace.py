"""Where the CPU expert engine's time goes between tasks, from its trace events
(CPUThreadPool.trace_start / trace_stop).

The pool's side, per pair of consecutive tasks: `run` (start -> end) and `idle_before` (the
previous task's end -> this start), split into `wait_submit` (the task had not been submitted yet;
a gated task counts as submitted when the GPU released it, i.e. the stream had not reached its go
word) and `start_latency` (submitted, or the previous task done, whichever was later -> started:
queue hand-over and thread wake-up). A layer's deferred task is queued right behind its immediate
one, so their pair shows no idle time; the totals say how much of the traced wall time the pool
sat idle.

The stream's side, per host function that waited for a task: `blocked` (the wait began -> it
returned: the stream stalled on the CPU), `wake` (the task ended, or the wait began if later ->
the wait returned) and, per release of the stream (a wait returning with no other return before
the next submit), `gpu_path` (that return -> the next submit: the GPU work and host-function
launches between one layer's CPU result and the next layer's CPU task), and `release_interval`, the
median time from one release to the next: with one wait a MoE layer, the period of a layer within a
step (the step boundary, one interval in several, does not move the median).
"""

from __future__ import annotations

import bisect
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


def _mean_us(v: list[int]) -> float:
    return statistics.fmean(v) / 1e3 if v else float("nan")


def summarize(events: torch.Tensor) -> dict[str, float]:
    """Means in microseconds (see the module docstring), counts, and totals in milliseconds over
    the traced wall time. Tasks missing an event (cut off by the capacity) are skipped."""
    tt = task_times(events)
    ids = sorted(i for i, v in tt.items() if {"submit", "start", "end"} <= v.keys())
    run = [tt[i]["end"] - tt[i]["start"] for i in ids]
    idle, wait_sub, lat = [], [], []
    for a, b in zip(ids, ids[1:]):
        if b != a + 1:
            continue
        pa, pb = tt[a], tt[b]
        idle.append(max(0, pb["start"] - pa["end"]))
        wait_sub.append(max(0, pb["submit"] - pa["end"]))
        lat.append(max(0, pb["start"] - max(pb["submit"], pa["end"])))
    waited = [tt[i] for i in ids if {"sync_enter", "sync_exit"} <= tt[i].keys()]
    blocked = [v["sync_exit"] - v["sync_enter"] for v in waited]
    wake = [max(0, v["sync_exit"] - max(v["sync_enter"], v["end"])) for v in waited]
    releases = sorted(v["sync_exit"] for v in waited)
    submits = sorted(tt[i]["submit"] for i in ids)
    gpu = []
    for r, r_next in zip(releases, releases[1:] + [None]):
        j = bisect.bisect_right(submits, r)
        if j < len(submits) and (r_next is None or submits[j] <= r_next):
            gpu.append(submits[j] - r)
    wall = tt[ids[-1]]["end"] - tt[ids[0]]["submit"] if ids else 0
    return {
        "tasks": float(len(ids)),
        "wall_ms": wall / 1e6,
        "run_us": _mean_us(run),
        "run_total_ms": sum(run) / 1e6,
        "idle_before_us": _mean_us(idle),
        "idle_total_ms": sum(idle) / 1e6,
        "wait_submit_us": _mean_us(wait_sub),
        "start_latency_us": _mean_us(lat),
        "waits": float(len(waited)),
        "blocked_us": _mean_us(blocked),
        "wake_us": _mean_us(wake),
        "releases": float(len(gpu)),
        "gpu_path_us": _mean_us(gpu),
        "release_interval_us": _median_us([b - a for a, b in zip(releases, releases[1:])]),
    }


def _median_us(v: list[int]) -> float:
    return statistics.median(v) / 1e3 if v else float("nan")


def format_summary(s: dict[str, float]) -> str:
    """One line for logs. (A stream that waits by memory operations runs no host function: the pool sees
    no waits, and its idle time before a task is the whole GPU path from a result to the next submit.)"""
    pool = (f"{int(s['tasks'])} tasks in {s['wall_ms']:.1f} ms: run {s['run_us']:.1f} us each "
            f"({s['run_total_ms']:.1f} ms), pool idle before a task {s['idle_before_us']:.1f} us "
            f"({s['idle_total_ms']:.1f} ms; nothing submitted {s['wait_submit_us']:.1f}, start latency "
            f"{s['start_latency_us']:.1f})")
    if not s["waits"]:
        return pool + "; no host-function waits"
    return (f"{pool}; {int(s['waits'])} stream waits: blocked {s['blocked_us']:.1f} us, return {s['wake_us']:.1f} us "
            f"after the task ends; next submit {s['gpu_path_us']:.1f} us after a release ({int(s['releases'])})")
