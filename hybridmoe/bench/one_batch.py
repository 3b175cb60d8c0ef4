"""`hybridmoe bench one-batch`: the latency of one static batch, in process (no server), like
SGLang's bench_one_batch. For each batch size: `batch` random prompts of `input-len` tokens are
prefilled together (prefill latency and input tokens/s), then decoded for `output-len` tokens
(median and p99 decode step latency, output tokens/s). A warm-up batch runs first.

Steps run without overlap scheduling (each step's sampled ids read before the next is scheduled:
the engine's own step latency) unless `--enable-overlap-schedule` is given.

Takes every engine flag of `serve` (`--model-path`, `--kt-*`, `--device`, ...); `--shape
qwen3-30b-a3b` benchmarks a published shape with random weights instead of a checkpoint.

    hybridmoe bench one-batch --batch-size 1 8 --input-len 256 --output-len 32 --out r.json
    hybridmoe bench one-batch --shape qwen3-30b-a3b --kt-num-gpu-experts 32 --batch-size 1 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridmoe.bench")


def build_parser() -> argparse.ArgumentParser:
    from hybridmoe.args import OneLineParser, add_engine_args
    from hybridmoe.bench.shapes import SHAPES

    p = OneLineParser(prog="hybridmoe bench one-batch", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    b = p.add_argument_group("benchmark")
    b.add_argument("--batch-size", type=int, nargs="+", default=[1], help="batch sizes to run (default 1)")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    b.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default 16)")
    b.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a published model shape with random weights (sets --model-path, --load-format dummy)")
    b.add_argument("--layers", type=int, default=None, help="with --shape: decoder layers (default: all)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _sync(engine: Any) -> None:
    import torch

    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def run_batch(engine: Any, batch: int, input_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    """Prefill `batch` random prompts together, then decode `output_len` tokens; latencies in ms."""
    import torch

    vocab = engine.hf_config.vocab_size
    g = torch.Generator().manual_seed(seed + batch)
    reqs = [engine.make_request(input_ids=torch.randint(10, vocab, (input_len,), generator=g).tolist(),
                                sampling_params={"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True})
            for _ in range(batch)]
    engine.kv.reset_prefix_cache()  # every run computes its whole prompt
    for r in reqs:
        engine.submit(r)
    _sync(engine)
    t0 = time.perf_counter()
    prefill_steps = 0
    while any(not r.output_ids and not r.finished for r in reqs):
        engine.step()
        prefill_steps += 1
    _sync(engine)
    prefill_s = time.perf_counter() - t0
    steps: list[float] = []
    while not all(r.finished for r in reqs):
        t = time.perf_counter()
        engine.step()  # reads the sampled ids: the step is done on the device when it returns
        steps.append(time.perf_counter() - t)
    failed = [r.finish_reason for r in reqs if (r.finish_reason or {}).get("type") == "abort"]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) of the batch failed: {failed[0]}")
    decode_s = sum(steps)
    return {
        "batch_size": batch, "input_len": input_len, "output_len": output_len,
        "prefill_latency_ms": prefill_s * 1e3, "prefill_steps": prefill_steps,
        "prefill_throughput_tok_s": batch * input_len / prefill_s,
        "decode_steps": len(steps),
        "decode_latency_ms_median": statistics.median(steps) * 1e3 if steps else float("nan"),
        "decode_latency_ms_p99": _percentile(steps, 99) * 1e3,
        "decode_throughput_tok_s": batch * len(steps) / decode_s if decode_s else float("nan"),
        "total_latency_ms": (prefill_s + decode_s) * 1e3,
    }


def gpu_memory_against_plan(engine) -> dict | None:
    """Peak GPU memory the allocator reserved so far against the startup memory plan's total (its KV
    cache line as allocated); None without a CUDA device or a hybrid plan."""
    import torch

    plan = getattr(engine.runner.moe, "memory_plan", None)
    if plan is None or engine.runner.device.type != "cuda":
        return None
    peak, total = torch.cuda.max_memory_reserved(engine.runner.device), sum(plan.gpu.values())
    return {"peak_reserved_gib": peak / 2**30, "plan_gib": total / 2**30, "peak_over_plan": peak / total,
            "plan": {k: v / 2**30 for k, v in plan.gpu.items()}}


def _engine_args(ns: argparse.Namespace):
    from hybridmoe.args import engine_args_from

    if ns.shape is not None:
        from hybridmoe.bench.shapes import write_shape_dir

        ns.model_path = str(write_shape_dir(ns.shape, layers=ns.layers))
        ns.load_format, ns.skip_tokenizer_init = "dummy", True
    args = engine_args_from(ns)
    if not args.enable_overlap_schedule:  # each step's latency alone, as SGLang's bench_one_batch measures it
        args = dataclasses.replace(args, disable_overlap_schedule=True)
    longest = ns.input_len + ns.output_len
    if args.context_length is None or args.context_length < longest + 1:
        args = dataclasses.replace(args, context_length=max(args.context_length or 0, longest + 1))
    biggest = max(ns.batch_size)
    if args.max_running_requests < biggest:
        args = dataclasses.replace(args, max_running_requests=biggest)
    return args


def main(argv: list[str] | None = None) -> int:
    from hybridmoe.config import ConfigError
    from hybridmoe.log import configure
    from hybridmoe.startup import log_summary, prepare, report_failure

    ns = build_parser().parse_args(argv)
    configure(ns.log_level)
    try:
        if min(ns.batch_size) < 1 or ns.input_len < 1 or ns.output_len < 1:
            raise ConfigError("--batch-size, --input-len and --output-len must be at least 1")
        args = prepare(_engine_args(ns))
        from hybridmoe.engine.engine import Engine

        engine = Engine(args)
        log_summary(engine)
        run_batch(engine, 1, min(ns.input_len, 16), 2, ns.seed)  # warm-up (kernels, graphs, caches)
        results = []
        print(f"{'batch':>5} {'prefill ms':>10} {'prefill tok/s':>13} {'decode ms':>9} {'decode p99':>10} "
              f"{'decode tok/s':>12}")
        for b in ns.batch_size:
            r = run_batch(engine, b, ns.input_len, ns.output_len, ns.seed)
            results.append(r)
            print(f"{b:>5} {r['prefill_latency_ms']:>10.1f} {r['prefill_throughput_tok_s']:>13.1f} "
                  f"{r['decode_latency_ms_median']:>9.2f} {r['decode_latency_ms_p99']:>10.2f} "
                  f"{r['decode_throughput_tok_s']:>12.1f}", flush=True)
        memory = gpu_memory_against_plan(engine)
        if memory:
            print(f"GPU memory: peak reserved {memory['peak_reserved_gib']:.2f} GiB, startup plan "
                  f"{memory['plan_gib']:.2f} GiB (ratio {memory['peak_over_plan']:.3f})", flush=True)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        return report_failure("hybridmoe bench one-batch", e, ns.log_level == "debug")
    if ns.out:
        config = {k: v for k, v in dataclasses.asdict(args).items() if k != "cpu_engine"}
        Path(ns.out).write_text(json.dumps({"benchmark": "one-batch", "config": config, "results": results,
                                            "gpu_memory": memory},
                                           indent=2, default=str) + "\n")
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
