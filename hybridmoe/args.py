"""Command-line flags of the engine (SGLang + kt names) -> EngineArgs. Shared by `serve` and
`generate`; each flag is the EngineArgs field of the same name in snake_case."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import NoReturn

from hybridmoe.config import DEMO_MODEL_PATH, DTYPES, KT_METHODS, PLACEMENT_STRATEGIES, EngineArgs


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _count_or_auto(value: str) -> int | str:
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {value!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    m = p.add_argument_group("model")
    m.add_argument("--model-path", "--model", dest="model_path", default=DEMO_MODEL_PATH,
                   help="Hugging Face model directory (default: the bundled demo model)")
    m.add_argument("--tokenizer-path", default=None)
    m.add_argument("--served-model-name", default=None)
    m.add_argument("--trust-remote-code", action="store_true")
    m.add_argument("--device", default=d.device, choices=["auto", "cuda", "cpu"])
    m.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    m.add_argument("--context-length", type=int, default=None)
    m.add_argument("--random-seed", type=int, default=d.random_seed)
    m.add_argument("--skip-tokenizer-init", action="store_true")
    m.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights (benchmarks without a checkpoint)")
    m.add_argument("--fp8-dequantize", action="store_true",
                   help="block-scaled FP8 checkpoints (DeepSeek-V3 style): dequantize every FP8 weight, routed "
                        "experts included, to --dtype at load (default: linears stay FP8 with a Triton W8A8 GEMM "
                        "on GPUs with FP8, sm_89+, and are dequantized elsewhere; experts stay FP8)")
    r = p.add_argument_group("runtime")
    r.add_argument("--mem-fraction-static", type=float, default=None,
                   help="fraction of GPU memory for weights and KV cache (default 0.85)")
    r.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens")
    r.add_argument("--page-size", type=int, default=d.page_size)
    r.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    r.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    r.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    r.add_argument("--disable-radix-cache", action="store_true", help="turn prefix caching off")
    r.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    r.add_argument("--moe-backend", default=None, choices=["torch", "triton", "cpu"])
    r.add_argument("--disable-cuda-graph", action="store_true")
    r.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs)
    r.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    r.add_argument("--decode-log-interval", type=int, default=d.decode_log_interval,
                   help=f"log a 'Decode batch.' line every this many decode steps (default {d.decode_log_interval})")
    r.add_argument("--log-requests", action="store_true", help="log a line per request received and finished")
    r.add_argument("--log-requests-level", type=int, default=d.log_requests_level, choices=[0, 1, 2, 3],
                   help="0 counts, 1 + sampling params, 2 + partial text, 3 everything "
                        f"(default {d.log_requests_level})")
    k = p.add_argument_group("hybrid CPU/GPU experts (KTransformers-compatible)")
    k.add_argument("--kt-weight-path", default=None, help="CPU expert weights written by `hybridmoe convert`")
    k.add_argument("--kt-method", default=d.kt_method, type=str.upper, choices=KT_METHODS)
    k.add_argument("--kt-cpuinfer", type=int, default=None, help="CPU expert threads")
    k.add_argument("--kt-threadpool-count", type=int, default=d.kt_threadpool_count)
    k.add_argument("--kt-numa-nodes", default=None,
                   help="NUMA nodes whose cores run the CPU experts, e.g. 0,1 (one sub-pool per node)")
    k.add_argument("--kt-num-gpu-experts", type=_count_or_auto, default=None,
                   help="GPU-resident experts per MoE layer; auto: the most that fit the GPU for --context-length "
                        "(and --max-total-tokens), sized at startup (default: no GPU/CPU split)")
    k.add_argument("--kt-gpu-experts-ratio", type=float, default=None)
    k.add_argument("--kt-expert-placement-strategy", default=d.kt_expert_placement_strategy,
                   choices=PLACEMENT_STRATEGIES)
    k.add_argument("--init-expert-location", default=None)
    k.add_argument("--kt-max-deferred-experts-per-token", type=int, default=d.kt_max_deferred_experts_per_token)
    k.add_argument("--kt-gpu-prefill-token-threshold", type=int, default=None,
                   help="prefill chunks of at least this many tokens stream the CPU experts to the GPU layer by layer")
    k.add_argument("--kt-enable-dynamic-expert-update", action="store_true",
                   help="after a layerwise prefill, its most used experts take the least used GPU slots")
    k.add_argument("--record-expert-distribution", default=None)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs of parsed flags; `--kt-num-gpu-experts auto` is sized here (hybridmoe/sizing.py)."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    auto = kwargs.get("kt_num_gpu_experts") == "auto"
    if auto:
        kwargs["kt_num_gpu_experts"] = None
    args = EngineArgs.from_kwargs(**kwargs)
    if auto:
        from hybridmoe.sizing import resolve_auto_gpu_experts

        args = dataclasses.replace(args, kt_num_gpu_experts=resolve_auto_gpu_experts(args))
    return args
