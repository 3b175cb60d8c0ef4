"""Command-line flags of the engine (SGLang + kt names) -> EngineArgs. Shared by `serve` and
`generate`; each flag is the EngineArgs field of the same name in snake_case."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import NoReturn

from hybridmoe.chat_templates import BUILTIN_TEMPLATES
from hybridmoe.config import (
    CPU_DENSE_WEIGHTS,
    DEMO_MODEL_PATH,
    DTYPES,
    KT_METHODS,
    PLACEMENT_STRATEGIES,
    ConfigError,
    EngineArgs,
    kt_method_name,
)
from hybridmoe.sglang_compat import ATTENTION_BACKEND_ALIASES, KV_CACHE_DTYPES, SCHEDULE_POLICIES, add_compat_args

log = logging.getLogger("hybridmoe.args")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the flag (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


KT_METHOD_HELP = (
    "format and kernel of the CPU experts: AMXINT8 (int8, per-channel scales), AMXINT4 (int4, groups of 128), "
    "BF16, FP8 (the checkpoint's own block-FP8 experts, no conversion), LLAMAFILE (the GGUF blocks of --kt-weight-path or a GGUF --model, computed as they are; GPU experts dequantized). "
    "hybridmoe's default is AMXINT8 for accuracy; KTransformers' kt-sglang stack defaults to AMXINT4, which "
    "halves the CPU expert memory and bandwidth at some accuracy: pass --kt-method AMXINT4 for its behaviour. "
    "None needs AMX: the fastest ISA present (AMX, AVX-512, AVX2) is chosen at run time")
def kt_method_arg(value: str) -> str:
    """argparse type of --kt-method (config.kt_method_name): argparse's one-line error naming the flag."""
    try:
        return kt_method_name(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count_or_auto(value: str) -> int | str:
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {value!r}") from None


class _JoinNodes(argparse.Action):
    """--kt-numa-nodes as one list (`0,1`, `0-3`) or as KTransformers' separate values (`0 1`): one string."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, ",".join(values))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (EngineArgs fields), each with help; shared by `serve` and `generate`."""
    d = EngineArgs()
    m = p.add_argument_group("model")
    m.add_argument("--model-path", "--model", dest="model_path", default=DEMO_MODEL_PATH,
                   help="Hugging Face model directory, or a Hub id (org/name, downloaded through huggingface_hub); "
                        "the default is the bundled demo model")
    m.add_argument("--tokenizer-path", default=None, help="tokenizer directory; unset: --model-path")
    m.add_argument("--revision", default=None, help="branch, tag or commit of a Hub id given as --model-path")
    m.add_argument("--download-dir", default=None, help="cache directory for Hub downloads; unset: huggingface_hub's")
    m.add_argument("--served-model-name", default=None, help="the model name of the OpenAI API; unset: --model-path")
    m.add_argument("--trust-remote-code", action="store_true", help="run the model repository's own Python code")
    m.add_argument("--device", default=d.device, choices=["auto", "cuda", "cpu"],
                   help="auto: cuda when a GPU is visible; cpu runs everything on the CPU")
    m.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weights and activations; auto: the config's")
    m.add_argument("--context-length", type=int, default=None, help="unset: the model's max_position_embeddings")
    m.add_argument("--chat-template", default=None,
                   help=f"a Jinja chat template file, or a built-in name ({', '.join(BUILTIN_TEMPLATES)}); "
                        "unset: the tokenizer's")
    m.add_argument("--random-seed", type=int, default=d.random_seed, help="torch seed and placement seed")
    m.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: token ids in and out")
    m.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights (benchmarks without a checkpoint)")
    m.add_argument("--fp8-dequantize", action="store_true",
                   help="block-scaled FP8 checkpoints (DeepSeek-V3 style): dequantize every FP8 weight, routed "
                        "experts included, to --dtype at load (unset: linears stay FP8 with a Triton W8A8 GEMM "
                        "on GPUs with FP8, sm_89+, and are dequantized elsewhere; experts stay FP8)")
    r = p.add_argument_group("runtime")
    r.add_argument("--mem-fraction-static", type=float, default=None,
                   help="fraction of GPU memory for weights and KV cache; unset: 0.85")
    r.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache size in tokens; unset: what --mem-fraction-static leaves (CPU: 4x the context)")
    r.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="auto: the model dtype; fp8_e4m3/fp8_e5m2 store K/V as unscaled FP8 (half the memory), "
                        "upcast in the attention kernels (not for MLA models)")
    r.add_argument("--cpu-dense-weights", default=d.cpu_dense_weights, choices=CPU_DENSE_WEIGHTS,
                   help="CPU-only decode (--device cpu, every expert on the CPU, bf16): the dense linears' weights (all but "
                        "the MoE routers) as each token reads them; int8 keeps a per-row int8 copy beside the bf16 "
                        "weights (prefill) and quantizes the activations per token, as the INT8 experts do: half the "
                        "bytes of those matrices, logits ~1%% off bf16")
    r.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (SGLang's default is 1)")
    r.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="most prompt tokens per step; -1: no chunking")
    r.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="requests decoded together at most")
    r.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens, help="prompt tokens per step")
    r.add_argument("--schedule-policy", default=d.schedule_policy, choices=SCHEDULE_POLICIES,
                   help="order of waiting requests: fcfs (arrival) or lpm (longest cached prefix first)")
    r.add_argument("--disable-radix-cache", action="store_true", help="turn prefix caching off")
    r.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKEND_ALIASES),
                   help="torch or triton; SGLang's names run ours (torch_native: torch; flashinfer, fa3, flashmla, "
                        "...: the device default), said in one log line; unset: triton on CUDA, torch on the CPU")
    r.add_argument("--moe-backend", default=None, choices=["torch", "triton", "cpu"],
                   help="routed experts' kernels; unset: from --device and the --kt-* flags")
    r.add_argument("--disable-cuda-graph", action="store_true", help="decode without CUDA graphs")
    r.add_argument("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", type=int, dest="cuda_graph_max_bs",
                   default=d.cuda_graph_max_bs,
                   help="largest captured batch size (SGLang 0.5.23's --cuda-graph-max-bs-decode is the same flag)")
    r.add_argument("--cuda-graph-max-prefill-tokens", "--piecewise-cuda-graph-max-tokens", type=int,
                   dest="cuda_graph_max_prefill_tokens", default=d.cuda_graph_max_prefill_tokens,
                   help="batches with prompt tokens, up to this many new tokens in up to --cuda-graph-max-bs "
                        "sequences, replay a captured graph (every expert on the GPU, non-MLA attention, no LoRA); "
                        "0: prefill eagerly "
                        "(SGLang's --piecewise-cuda-graph-max-tokens is the same flag here)")
    r.add_argument("--disable-piecewise-cuda-graph", "--disable-prefill-cuda-graph", action="store_const", const=0,
                   dest="cuda_graph_max_prefill_tokens",
                   help="SGLang's names for --cuda-graph-max-prefill-tokens 0: prompt batches run eagerly")
    r.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each step's sampled tokens before scheduling the next step (default with CUDA: the "
                        "next step is scheduled and launched while the GPU runs this one, its tokens read after)")
    r.add_argument("--enable-overlap-schedule", action="store_true",
                   help="overlap scheduling with --device cpu too (off there by default)")
    r.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="a stream sends an update every this many new tokens (and the last one)")
    r.add_argument("--allow-auto-truncate", action="store_true",
                   help="cut prompts longer than the context to fit (their first tokens kept) instead of refusing")
    r.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout,
                   help="seconds one engine step may take; beyond, the server logs the engine's stack and exits "
                        "(status 1); --device cpu with a large model and long prefill chunks may need more")
    r.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="logging level")
    r.add_argument("--log-requests", action="store_true", help="one log line per request received and finished")
    r.add_argument("--log-requests-level", type=int, default=d.log_requests_level, choices=[0, 1, 2, 3],
                   help="0: metadata; 1: + sampling parameters; 2: + the first and last characters of the input "
                        "and output; 3: + all of them")
    r.add_argument("--decode-log-interval", type=int, default=d.decode_log_interval,
                   help="decode steps between two progress log lines")
    r.add_argument("--enable-cache-report", action="store_true",
                   help="OpenAI responses carry usage.prompt_tokens_details.cached_tokens")
    k = p.add_argument_group("hybrid CPU/GPU experts (KTransformers-compatible)")
    k.add_argument("--kt-weight-path", "--kt-amx-weight-path", dest="kt_weight_path", default=None,
                   help="CPU expert weights written by `hybridmoe convert`; unset: quantized from the checkpoint "
                        "(--kt-amx-weight-path: KTransformers' older name)")
    k.add_argument("--kt-method", "--kt-amx-method", dest="kt_method", default=d.kt_method, type=kt_method_arg,
                   metavar="{" + ",".join(KT_METHODS) + "}",
                   help=KT_METHOD_HELP + " (--kt-amx-method: KTransformers' older name; its AMXBF16 is BF16)")
    k.add_argument("--kt-cpuinfer", type=int, default=None, help="CPU expert threads; unset: physical cores - 1")
    k.add_argument("--kt-threadpool-count", type=int, default=d.kt_threadpool_count,
                   help="CPU thread sub-pools (one per NUMA node)")
    k.add_argument("--kt-numa-nodes", nargs="+", action=_JoinNodes, default=None, metavar="NODES",
                   help="NUMA nodes whose cores run the CPU experts, e.g. 0,1 or 0 1 (KTransformers' form) (one "
                        "sub-pool per node); unset: all")
    k.add_argument("--kt-num-gpu-experts", type=_count_or_auto, default=None,
                   help="GPU-resident routed experts per MoE layer; auto: the most that fit the GPU for "
                        "--context-length (and --max-total-tokens), sized at startup; unset (and no ratio): no "
                        "GPU/CPU split, every expert on --device")
    k.add_argument("--kt-gpu-experts-ratio", type=float, default=None,
                   help="GPU-resident share of the routed experts (0 to 1): floor(ratio x experts x MoE layers) in "
                        "all, split evenly over the MoE layers (the first ones take the remainder); wins over "
                        "--kt-num-gpu-experts, as in SGLang's kt wrapper")
    k.add_argument("--kt-expert-placement-strategy", default=d.kt_expert_placement_strategy,
                   choices=PLACEMENT_STRATEGIES, help="which experts go to the GPU")
    k.add_argument("--init-expert-location", default=None,
                   help="activation statistics of the `frequency` strategy: a file from --record-expert-distribution, "
                        "or SGLang's expert distribution record (/dump_expert_distribution_record, stat mode: a .pt "
                        "file, or a .json file or inline JSON object with logical_count); 'trivial' (SGLang's "
                        "default) holds none, which `frequency` refuses (use uniform)")
    k.add_argument("--kt-max-deferred-experts-per-token", type=int, default=d.kt_max_deferred_experts_per_token,
                   help="CPU experts per token whose result may join the next layer (overlap)")
    k.add_argument("--kt-gpu-prefill-token-threshold", type=int, default=None,
                   help="prefill chunks of at least this many tokens stream the CPU experts to the GPU layer by layer")
    k.add_argument("--kt-enable-dynamic-expert-update", action="store_true",
                   help="after a layerwise prefill, its most used experts take the least used GPU slots")
    k.add_argument("--hybrid-stream-wait", default=d.hybrid_stream_wait, choices=["auto", "memop", "hostfn"],
                   help="how the GPU stream waits for a layer's CPU experts: memop (the GPU polls a word the CPU sets; "
                        "CUDA 12+ drivers), hostfn (a CUDA host function); auto: memop where the driver has it")
    k.add_argument("--record-expert-distribution", default=None,
                   help="write the routed experts' activation statistics to this file at shutdown")
    lo = p.add_argument_group("LoRA adapters (SGLang-compatible)")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths)")
    lo.add_argument("--lora-paths", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT adapter directories served at startup, name=path or a path (named by its directory)")
    lo.add_argument("--max-loras-per-batch", type=int, default=d.max_loras_per_batch,
                    help="adapter slots: distinct adapters in one batch at most")
    lo.add_argument("--max-lora-rank", type=int, default=None,
                    help="rank of the slot buffers; unset: the largest rank of --lora-paths (64 without)")
    lo.add_argument("--max-loaded-loras", type=int, default=None,
                    help="adapters held in host memory at most (/load_lora_adapter beyond is refused); unset: no "
                         "bound but the host memory")
    lo.add_argument("--lora-target-modules", nargs="+", default=None,
                    help="module names that take LoRA (q_proj ... down_proj, or all); unset: those the --lora-paths "
                         "adapters target")
    lo.add_argument("--kt-expert-lora-path", default=None,
                    help="the routed experts' half of the --lora-paths adapter (a convert-lora expert directory)")
    add_compat_args(p)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs of parsed flags; `--kt-num-gpu-experts auto` is sized here (hybridmoe/sizing.py)."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    auto = kwargs.get("kt_num_gpu_experts") == "auto"
    if auto:
        kwargs["kt_num_gpu_experts"] = None
    args = EngineArgs.from_kwargs(**kwargs)
    if auto and args.kt_gpu_experts_ratio is not None:  # the ratio sets the count (placement.gpu_expert_counts)
        log.info("--kt-num-gpu-experts auto: --kt-gpu-experts-ratio %g sets the GPU experts; not sized",
                 args.kt_gpu_experts_ratio)
    elif auto:
        from hybridmoe.sizing import resolve_auto_gpu_experts

        args = dataclasses.replace(args, kt_num_gpu_experts=resolve_auto_gpu_experts(args))
    return args
