"""Prometheus metrics with SGLang's names (`sglang:*`), fed from the engine thread after each step."""

from __future__ import annotations

import collections
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hybridmoe.engine.request import Req

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no `*_created` series: SGLang does not export them either

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.0, 5.0)
_THROUGHPUT_WINDOW_S = 5.0
HYBRID_GAUGES = (  # (Engine.stats key, metric name, help)
    ("cpu_expert_time_per_step", "hybridmoe:cpu_expert_time_per_step_seconds",
     "CPU expert task time per forward (all tasks, summed over the CPU engine's threads' phases)"),
    ("gpu_expert_hit_share", "hybridmoe:gpu_expert_hit_share", "Share of routed-expert selections on GPU experts"),
    ("deferred_experts_per_token", "hybridmoe:deferred_experts_per_token", "Deferred CPU experts per token"),
    ("num_layerwise_prefills", "hybridmoe:layerwise_prefills", "Forwards run as a layerwise prefill so far"),
)


class ServerMetrics:
    """Gauges, counters and latency histograms; `on_step` must be called from one thread."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        self.num_running = gauge("sglang:num_running_reqs", "Running requests")
        self.num_queue = gauge("sglang:num_queue_reqs", "Requests waiting in the queue")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "KV cache tokens held by requests")
        self.token_usage = gauge("sglang:token_usage", "Fraction of the KV cache held by requests")
        self.gen_throughput_g = gauge("sglang:gen_throughput", "Generation throughput (tokens/s)")
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens", labels, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache", labels,
                                     registry=r)
        self.num_requests = Counter("sglang:num_requests", "Finished requests", labels, registry=r)
        self.num_aborted = Counter("sglang:num_aborted_requests", "Requests that ended with an abort", labels,
                                   registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time between two tokens of a request", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Share of admitted prompt tokens served from the prefix cache")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV cache capacity in tokens")
        self.num_retracted = gauge("sglang:num_retracted_reqs", "Requests preempted (retracted) so far")
        self.queue_time = Histogram("sglang:queue_time_seconds", "Arrival to admission into the running batch",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        # hybrid CPU/GPU experts (no SGLang counterpart); refreshed every --decode-log-interval decode steps
        self.hybrid = {key: gauge(name, doc) for key, name, doc in HYBRID_GAUGES}
        self.labels = {"model_name": model_name}
        self._seen: dict[str, tuple[int, float]] = {}  # rid -> (tokens seen, time of the last one)
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self.gen_throughput = 0.0

    def on_step(self, updated: list[Req], now: float | None = None) -> None:
        """Account one engine step: latencies of new tokens, totals of finished requests."""
        now = time.time() if now is None else now
        lab = self.labels
        new_total = 0
        for req in updated:
            n = len(req.output_ids)
            seen, last = self._seen.get(req.rid, (0, req.arrival_time))
            new = n - seen
            if new > 0:
                new_total += new
                if seen == 0:
                    self.ttft.labels(**lab).observe(max(0.0, (req.first_token_time or now) - req.arrival_time))
                else:
                    gap = (now - last) / new
                    for _ in range(new):
                        self.itl.labels(**lab).observe(gap)
                self.generation_tokens.labels(**lab).inc(new)
            if req.finished:
                self._seen.pop(req.rid, None)
                self.num_requests.labels(**lab).inc()
                self.prompt_tokens.labels(**lab).inc(len(req.prompt_ids))
                self.cached_tokens.labels(**lab).inc(req.cached_tokens)
                self.e2e.labels(**lab).observe(max(0.0, (req.finished_time or now) - req.arrival_time))
                if req.finish_reason and req.finish_reason.get("type") == "abort":
                    self.num_aborted.labels(**lab).inc()
            elif new > 0:
                self._seen[req.rid] = (n, now)
        self._window.append((now, new_total))
        while self._window and self._window[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._window.popleft()
        span = max(now - self._window[0][0], 1.0) if len(self._window) > 1 else _THROUGHPUT_WINDOW_S
        self.gen_throughput = sum(t for _, t in self._window) / span

    def set_gauges(self, stats: dict[str, Any]) -> None:
        lab = self.labels
        self.num_running.labels(**lab).set(stats["num_running_reqs"])
        self.num_queue.labels(**lab).set(stats["num_queue_reqs"])
        self.num_used_tokens.labels(**lab).set(stats["num_used_tokens"])
        self.token_usage.labels(**lab).set(stats["token_usage"])
        self.gen_throughput_g.labels(**lab).set(stats["gen_throughput"])
        self.cache_hit_rate.labels(**lab).set(stats.get("cache_hit_rate", 0.0))
        self.max_total_num_tokens.labels(**lab).set(stats.get("max_total_num_tokens", 0))
        self.num_retracted.labels(**lab).set(stats.get("num_retracted_reqs", 0))
        for key, g in self.hybrid.items():
            if key in stats:
                g.labels(**lab).set(stats[key])

    def observe_queue_times(self, seconds: list[float]) -> None:
        for t in seconds:
            self.queue_time.labels(**self.labels).observe(t)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
