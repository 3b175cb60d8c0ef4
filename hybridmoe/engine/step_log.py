"""The periodic decode log line (SGLang's "Decode batch. ..." every --decode-log-interval decode
steps) and the hybrid counters behind it and the metrics.

Nothing here syncs with the GPU per step: per step it counts Python integers; every interval it
reads the CPU engine's phase-time sums (a ctypes call) and the expert-hit counts (a few [E]
tensors copied to the host, between two steps, where the engine has synced on the sampled ids
anyway).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("hybridmoe.engine")


def _cpu_task_seconds() -> float | None:
    """Seconds spent in CPU expert tasks since the process started (all pools), or None."""
    try:
        from hybridmoe.cpu import native

        p = native.profile(reset=False)
    except Exception:  # noqa: BLE001  (no native library: no CPU engine time to report)
        return None
    return sum(p[k] for k in native.PROFILE_PHASES)


class StepLog:
    """Counts steps and tokens; every `interval` decode steps logs one line and refreshes `hybrid`."""

    def __init__(self, engine: Any, interval: int) -> None:
        self.engine = engine
        self.interval = max(0, int(interval))
        self.decode_steps = 0
        self._t = time.perf_counter()
        self._tokens = 0  # sampled since the last line
        self._steps = 0  # forwards since the last line
        self._cached = self._prompt = 0  # admission counters at the last line
        runner = engine.runner
        self.has_cpu = runner.moe.backend in ("cpu", "hybrid")
        self._cpu_s = _cpu_task_seconds() if self.has_cpu else None
        self._hits: dict[int, list[int]] | None = None
        self.hybrid: dict[str, float] = {}
        rt = runner.hybrid
        if rt is not None:
            self.hybrid["deferred_experts_per_token"] = float(rt.num_deferred)

    def on_step(self, is_decode: bool, sampled: int) -> None:
        """After each forward: `sampled` tokens were produced."""
        self._steps += 1
        self._tokens += sampled
        if not is_decode:
            return
        self.decode_steps += 1
        if self.interval and self.decode_steps % self.interval == 0:
            self.report()

    # ---- every interval ----
    def _gpu_hit_share(self) -> float | None:
        """Share of the routed-expert selections since the last call that hit a GPU-resident expert."""
        runner = self.engine.runner
        rt, rec = runner.hybrid, runner.recorder
        if rt is None or rec is None:
            return None
        counts = {k: v.tolist() for k, v in rec.counts.items()}
        prev, self._hits = self._hits, counts
        hit = total = 0
        for layer, c in counts.items():
            old = prev.get(layer) if prev else None
            delta = [a - b for a, b in zip(c, old)] if old else c
            mask = rt.layers[layer].mask.tolist() if layer in rt.layers else rt.placement.masks[layer].tolist()
            hit += sum(d for d, on in zip(delta, mask) if on)
            total += sum(delta)
        return hit / total if total else None

    def refresh(self) -> dict[str, float]:
        """The hybrid counters over the steps since the last refresh."""
        steps = max(1, self._steps)
        if self.has_cpu:
            now = _cpu_task_seconds()
            if now is not None and self._cpu_s is not None:
                self.hybrid["cpu_expert_time_per_step"] = (now - self._cpu_s) / steps
            self._cpu_s = now
        share = self._gpu_hit_share()
        if share is not None:
            self.hybrid["gpu_expert_hit_share"] = share
        rt = self.engine.runner.hybrid
        if rt is not None:
            self.hybrid["deferred_experts_per_token"] = float(rt.num_deferred)
            self.hybrid["num_layerwise_prefills"] = float(rt.num_layerwise_prefills)
        return self.hybrid

    def report(self) -> None:
        e, s = self.engine, self.engine.scheduler
        now = time.perf_counter()
        throughput = self._tokens / max(now - self._t, 1e-9)
        prompt, cached = s.admitted_prompt_tokens - self._prompt, s.admitted_cached_tokens - self._cached
        hit_rate = cached / prompt if prompt else 0.0
        h = self.refresh()
        st = e.stats()
        line = (f"Decode batch. #running-req: {st['num_running_reqs']}, #token: {st['num_used_tokens']}, "
                f"token usage: {st['token_usage']:.2f}, cache hit rate: {100 * hit_rate:.1f}%, "
                f"gen throughput (token/s): {throughput:.2f}, #queue-req: {st['num_queue_reqs']}")
        if "cpu_expert_time_per_step" in h:
            line += f", CPU expert time/step: {1000 * h['cpu_expert_time_per_step']:.2f} ms"
        if "gpu_expert_hit_share" in h:
            line += f", GPU expert hits: {100 * h['gpu_expert_hit_share']:.1f}%"
        log.info("%s", line)
        self._t, self._tokens, self._steps = now, 0, 0
        self._prompt, self._cached = s.admitted_prompt_tokens, s.admitted_cached_tokens
