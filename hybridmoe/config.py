"""Engine configuration: user options in, typed frozen configs out.

`EngineArgs` holds every engine option in snake_case (the CLI flag `--kt-num-gpu-experts` is the
field `kt_num_gpu_experts`); `EngineArgs.from_kwargs` is the only path from user options to a
validated configuration, used by both `LLM(**options)` and `hybridmoe serve`, and `validate` is
the one place where every flag and cross-flag rule is checked. The parts of the engine receive
the typed views built from it: `CacheConfig`, `SchedulerConfig`, `HybridConfig` (every `--kt-*`
flag and the CPU engine settings) and `ModelConfig` (what the engine reads of the model's HF
config, built once by `models.registry.model_config`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridmoe.cpu.settings import CPUEngineSettings
from hybridmoe.sglang_compat import ATTENTION_BACKEND_ALIASES, KV_CACHE_DTYPES, SCHEDULE_POLICIES
from hybridmoe.sglang_flags import (
    REASONING_PARSER_ALIASES,
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_CALL_PARSERS,
    TOOL_CALL_PARSER_ALIASES,
)

if TYPE_CHECKING:
    from hybridmoe.models.base import ArchSpec

log = logging.getLogger(__name__)

DEMO_MODEL_PATH = str(Path(__file__).parent / "demo_model")

CPU_DENSE_WEIGHTS = ("bf16", "int8")
KT_METHODS = ("AMXINT8", "AMXINT4", "BF16", "LLAMAFILE", "FP8")
# KTransformers' other names of the same methods (its kt-sglang fork maps AMXBF16 and BF16 to one kernel)
KT_METHOD_ALIASES = {"AMXBF16": "BF16"}
# its methods whose formats hybridmoe does not compute (native int4 and fp4/fp8 checkpoints, its non-AMX int paths)
KT_METHODS_NOT_IMPLEMENTED = ("RAWINT4", "FP8_PERCHANNEL", "GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8", "MOE_INT4",
                              "MOE_INT8")


def kt_method_name(value: str) -> str:
    """--kt-method: hybridmoe's name of a method (KTransformers' names taken, case-insensitive); ConfigError
    naming the value and what is accepted."""
    name = value.strip().upper()
    name = KT_METHOD_ALIASES.get(name, name)
    if name in KT_METHODS:
        return name
    what = (f"{value!r} is a KTransformers method whose weight format hybridmoe does not compute"
            if name in KT_METHODS_NOT_IMPLEMENTED else f"{value!r} is not a CPU expert method")
    also = ", ".join(f"{a} = {to}" for a, to in KT_METHOD_ALIASES.items())
    raise ConfigError(f"{what}; accepted: {', '.join(KT_METHODS)} (also {also})")
PLACEMENT_STRATEGIES = ("uniform", "front-loading", "random", "frequency")
DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
# --tool-call-parser / --reasoning-parser names (SGLang's); the formats are in server/parsers/. SGLang's other
# names for the same formats (sglang_flags.py) are accepted too, as these.
TOOL_CALL_PARSERS = ("qwen25", "deepseekv3", "kimi_k2")
REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1", "kimi", "kimi_k2")
LOG_LEVELS = ("debug", "info", "warning", "error")
INT_MAX = 2**31 - 1  # counts and sizes beyond this are typos, and overflow int32 kernel arguments
MAX_NUMA_NODES = 1024  # Linux's MAX_NUMNODES at its largest (CONFIG_NODES_SHIFT 10): node ids are below it
_INT_FIELDS = ("context_length", "max_total_tokens", "page_size", "chunked_prefill_size", "max_running_requests",
               "max_prefill_tokens", "cuda_graph_max_bs", "cuda_graph_max_prefill_tokens", "kt_cpuinfer",
               "max_loras_per_batch", "max_lora_rank", "max_loaded_loras",
               "kt_threadpool_count", "kt_num_gpu_experts", "kt_max_deferred_experts_per_token",
               "kt_gpu_prefill_token_threshold", "stream_interval", "decode_log_interval", "log_requests_level")


class ConfigError(ValueError):
    """A bad option value; the message names the option and what was expected."""


def parser_names(ours: tuple[str, ...], aliases: dict[str, str]) -> str:
    """The accepted parser names as a message lists them: `qwen25 (also qwen, hermes), deepseekv3, ...`."""
    also = {n: [a for a, to in aliases.items() if to == n] for n in ours}
    return ", ".join(n + (f" (also {', '.join(also[n])})" if also[n] else "") for n in ours)


def _parser_name(kind: str, name: str, ours: tuple[str, ...], aliases: dict[str, str],
                 sglangs: tuple[str, ...]) -> str:
    if name in ours:
        return name
    if name in aliases:
        return aliases[name]
    accepted = parser_names(ours, aliases)
    what = (f"{name!r} is SGLang's parser for a {kind} format that hybridmoe does not implement" if name in sglangs
            else f"{name!r} is not a {kind} parser")
    raise ConfigError(f"{what}; accepted: {accepted}")


def tool_call_parser_name(name: str) -> str:
    """hybridmoe's name of the tool-call format `name` (one of SGLang's names); ConfigError naming the value and
    what is accepted."""
    return _parser_name("tool-call", name, TOOL_CALL_PARSERS, TOOL_CALL_PARSER_ALIASES, SGLANG_TOOL_CALL_PARSERS)


def reasoning_parser_name(name: str) -> str:
    """hybridmoe's name of the reasoning format `name` (one of SGLang's names); ConfigError as above."""
    return _parser_name("reasoning", name, REASONING_PARSERS, REASONING_PARSER_ALIASES, SGLANG_REASONING_PARSERS)


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """config.json's quantization_config.quant_method ("fp8" for DeepSeek-V3's block-scaled fp8), or None."""
    q = getattr(hf_config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    return (q or {}).get("quant_method")


def check_kt_method(method: str, hf_config: Any, source: str = "config.json") -> None:
    """--kt-method FP8 computes the checkpoint's own fp8 experts: only an fp8 checkpoint has them."""
    if method.upper() == "FP8" and checkpoint_quant_method(hf_config) != "fp8":
        raise ConfigError(f"--kt-method FP8: the checkpoint is not fp8 ({source} quantization_config.quant_method is "
                          f"{checkpoint_quant_method(hf_config)!r}, expected 'fp8'); use AMXINT8, AMXINT4 or BF16")


def check_kv_cache_dtype(args: EngineArgs, hf_config: Any) -> None:
    """--kv-cache-dtype against the model and the GPU: FP8 needs a standard-attention model (MLA's
    latent cache stays in the model dtype) and, for e4m3, a GPU with FP8 conversions (sm_89+)."""
    name = args.kv_cache_dtype
    if not name.startswith("fp8"):
        return
    if getattr(hf_config, "kv_lora_rank", None):
        raise ConfigError(f"--kv-cache-dtype {name}: not supported for MLA models (DeepSeek-V2/V3, Kimi-K2: the "
                          "latent cache stays in the model dtype); leave it at auto")
    import torch

    if name == "fp8_e4m3" and args.device != "cpu" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            raise ConfigError(f"--kv-cache-dtype fp8_e4m3: this GPU (sm_{cap[0]}{cap[1]}) has no e4m3 conversions "
                              "(sm_89+ has); use fp8_e5m2")


@dataclass
class EngineArgs:
    """All engine options (SGLang + kt names); the HTTP server's own are ServerConfig."""

    model_path: str = DEMO_MODEL_PATH
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    page_size: int = 16
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    disable_radix_cache: bool = False
    attention_backend: str | None = None  # torch | triton; default: triton on CUDA, torch on CPU
    moe_backend: str | None = None  # torch | triton | cpu; default from device and kt options
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    # prompt batches of up to this many new tokens replay a captured graph (engine/prefill_graph.py); 0: eager
    cuda_graph_max_prefill_tokens: int = 512
    # overlap scheduling (engine/pipeline.py): the host's work for step N+1 while the device runs step N;
    # default on with CUDA, off on the CPU device (HYBRIDMOE_OVERLAP_SCHEDULE=1/0 changes that default)
    disable_overlap_schedule: bool = False  # SGLang's flag
    enable_overlap_schedule: bool = False  # on with --device cpu too
    random_seed: int = 0
    log_level: str = "info"
    decode_log_interval: int = 40  # a "Decode batch." log line every this many decode steps (0: never)
    log_requests: bool = False  # a log line per request received and finished
    log_requests_level: int = 2  # 0 counts, 1 + sampling params, 2 + partial text, 3 everything
    skip_tokenizer_init: bool = False
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights, for benchmarks)
    fp8_dequantize: bool = False  # block-scaled fp8 checkpoints: every fp8 weight in --dtype at load
    kv_cache_dtype: str = "auto"  # auto (= the model dtype) | bf16 | fp8_e4m3 | fp8_e5m2 (unscaled fp8 K/V)
    # CPU-only decode (--device cpu, every expert on the CPU engine, bf16): the dense linears' weights as
    # a decode step reads them: bf16 (torch's values) | int8 (per-row int8 copies: half the bytes)
    cpu_dense_weights: str = "bf16"
    schedule_policy: str = "fcfs"  # fcfs | lpm (waiting requests with the longest cached prefix first)
    chat_template: str | None = None  # a Jinja file or a built-in name (chat_templates.py); None: the tokenizer's
    revision: str | None = None  # of a Hugging Face Hub id given as --model-path (hub.py)
    download_dir: str | None = None  # Hub cache directory (None: huggingface_hub's default)
    # serving (SGLang's ServerArgs names; read by the server and the engine loop)
    stream_interval: int = 1  # a stream sends an update every this many new tokens (and at the end)
    watchdog_timeout: float = 300.0  # a step running longer than this kills the server (seconds)
    allow_auto_truncate: bool = False  # prompts longer than the context are cut to fit, not refused
    enable_cache_report: bool = False  # usage.prompt_tokens_details.cached_tokens in OpenAI responses
    # hybrid (--kt-*)
    kt_weight_path: str | None = None
    kt_method: str = "AMXINT8"
    kt_cpuinfer: int | None = None
    kt_threadpool_count: int = 1
    kt_numa_nodes: str | None = None
    kt_num_gpu_experts: int | None = None
    kt_gpu_experts_ratio: float | None = None
    kt_expert_placement_strategy: str = "uniform"
    init_expert_location: str | None = None
    kt_max_deferred_experts_per_token: int = 0
    kt_gpu_prefill_token_threshold: int | None = None
    kt_enable_dynamic_expert_update: bool = False
    record_expert_distribution: str | None = None
    enable_lora: bool = False  # LoRA: SGLang's flags + the seed stack's --kt-expert-lora-path (lora/setup.py)
    lora_paths: list[str] | None = None  # name=path or path
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None  # unset: the largest rank of --lora-paths (64 without adapters)
    # adapters held in host memory at most (SGLang's flag); unset: no bound but the host memory
    max_loaded_loras: int | None = None
    lora_target_modules: list[str] | None = None  # unset: the modules the startup adapters target (all: every linear)
    kt_expert_lora_path: str | None = None
    # CPU engine and hybrid driving settings (measured defaults; benchmarks compare others)
    cpu_engine: CPUEngineSettings = field(default_factory=CPUEngineSettings)
    hybrid_blocking_sync: bool = True  # hybrid on CUDA: wait for a step's result sleeping, not spinning
    # hybrid on CUDA: how the stream waits for a CPU task: "memop" (the GPU polls a pinned word the pool
    # sets; moe/cuda_bridge.py), "hostfn" (a host function) or "auto" (memop where the driver has it: it
    # measured 3-6% faster decode, session 30)
    hybrid_stream_wait: str = "auto"

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        """Build and validate from user options; an unknown option is an error naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        if "model" in kwargs and "model_path" not in kwargs:  # SGLang accepts both spellings
            kwargs["model_path"] = kwargs.pop("model")
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; see `hybridmoe serve --help` for the accepted ones")
        args = cls(**kwargs)  # type: ignore[arg-type]
        args.validate()
        return args

    def validate(self) -> None:
        def need(ok: bool, flag: str, expected: str) -> None:
            if not ok:
                value = getattr(self, flag.lstrip("-").replace("-", "_"))
                raise ConfigError(f"--{flag}: got {value!r}, expected {expected}")

        for name in _INT_FIELDS:  # a float or a bool where a count is expected is a type error, not a count
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT_MAX),
                 name.replace("_", "-"), f"an integer (at most {INT_MAX})")
        for name in ("mem_fraction_static", "kt_gpu_experts_ratio"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                   and math.isfinite(value)), name.replace("_", "-"), "a number")
        need(self.device in ("auto", "cuda", "cpu"), "device", "cuda, cpu or auto")
        need(self.log_level in LOG_LEVELS, "log-level", f"one of {LOG_LEVELS}")
        need(isinstance(self.decode_log_interval, int) and self.decode_log_interval >= 0, "decode-log-interval",
             "an integer >= 0 (0: no decode log lines)")
        need(self.log_requests_level in (0, 1, 2, 3), "log-requests-level", "0, 1, 2 or 3")
        need(bool(self.model_path), "model-path", "a model directory")
        for name in ("tokenizer_path", "served_model_name", "kt_weight_path", "init_expert_location",
                     "record_expert_distribution", "kt_expert_lora_path"):  # ("" was taken as no flag)
            need(getattr(self, name) is None or bool(getattr(self, name)), name.replace("_", "-"),
                 "a non-empty value (or leave the flag out)")
        need(self.dtype in DTYPES, "dtype", f"one of {DTYPES}")
        need(self.max_loras_per_batch >= 1 and (self.max_lora_rank or 1) >= 1, "max-loras-per-batch", "counts >= 1")
        need(self.lora_target_modules is None or (isinstance(self.lora_target_modules, list) and all(
            isinstance(m, str) and m.strip() for m in self.lora_target_modules)), "lora-target-modules",
            "module names such as q_proj or all")  # (an empty name matched no module: LoRA on nothing, silently)
        n_paths = len(self.lora_paths) if isinstance(self.lora_paths, list) else int(bool(self.lora_paths))
        need(self.max_loaded_loras is None or self.max_loaded_loras >= max(1, n_paths),
             "max-loaded-loras", "a positive integer, at least the number of --lora-paths")
        need(self.load_format in ("auto", "dummy"), "load-format", "auto or dummy")
        need(self.page_size >= 1, "page-size", "a positive integer")
        need(self.chunked_prefill_size >= 1 or self.chunked_prefill_size == -1, "chunked-prefill-size",
             "a positive integer, or -1 to disable chunking")
        need(self.max_running_requests >= 1, "max-running-requests", "a positive integer")
        need(self.max_prefill_tokens >= 1, "max-prefill-tokens", "a positive integer (tokens per prefill step)")
        need(isinstance(self.random_seed, int) and 0 <= self.random_seed < 2**63, "random-seed",
             "an integer in [0, 2^63)")
        # two pages at least (engine/model_runner.py: page 0 is scratch): one page passed here, then failed after the
        # whole model load with "no memory left for the KV cache ... or set --max-total-tokens"
        need(self.max_total_tokens is None or self.max_total_tokens >= 2 * self.page_size, "max-total-tokens",
             f"a positive integer, at least --page-size x 2 ({2 * self.page_size})")
        need(self.page_size <= 4096, "page-size", "at most 4096 tokens")
        need(self.mem_fraction_static is None or 0.0 < self.mem_fraction_static < 1.0, "mem-fraction-static",
             "a fraction between 0 and 1")
        need(self.context_length is None or self.context_length >= 1, "context-length", "a positive integer")
        need(self.cuda_graph_max_bs >= 1, "cuda-graph-max-bs", "a positive integer")
        need(0 <= self.cuda_graph_max_prefill_tokens <= 8192, "cuda-graph-max-prefill-tokens",
             "an integer from 0 (prefill without graphs) to 8192")
        need(not (self.disable_overlap_schedule and self.enable_overlap_schedule), "enable-overlap-schedule",
             "not together with --disable-overlap-schedule")
        need(self.attention_backend in (None, *ATTENTION_BACKEND_ALIASES), "attention-backend",
             f"one of {tuple(ATTENTION_BACKEND_ALIASES)}")
        self._map_attention_backend()
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv-cache-dtype", f"one of {KV_CACHE_DTYPES}")
        need(self.cpu_dense_weights in CPU_DENSE_WEIGHTS, "cpu-dense-weights", f"one of {CPU_DENSE_WEIGHTS}")
        need(self.schedule_policy in SCHEDULE_POLICIES, "schedule-policy", f"one of {SCHEDULE_POLICIES}")
        need(self.stream_interval >= 1, "stream-interval", "a positive integer (tokens per streamed update)")
        need(isinstance(self.watchdog_timeout, (int, float)) and not isinstance(self.watchdog_timeout, bool)
             and math.isfinite(self.watchdog_timeout) and self.watchdog_timeout > 0, "watchdog-timeout",
             "a positive number of seconds")
        for name in ("chat_template", "revision", "download_dir"):
            need(getattr(self, name) is None or bool(getattr(self, name)), name.replace("_", "-"),
                 "a non-empty value (or leave the flag out)")
        if self.chat_template:
            from hybridmoe.chat_templates import load_chat_template

            try:
                load_chat_template(self.chat_template)
            except (ValueError, OSError) as e:
                raise ConfigError(str(e)) from None
        from hybridmoe.gguf.view import ERRORS, adopt_gguf_model  # --model FILE.gguf: as a model directory
        try:
            adopt_gguf_model(self)
        except ERRORS as e:
            raise ConfigError(f"--model-path: {e}") from None
        need(self.kt_method.upper() in KT_METHODS, "kt-method", f"one of {KT_METHODS}")
        self.kt_method = self.kt_method.upper()
        # FP8 reads the experts straight from the fp8 checkpoint: --kt-weight-path, if given, is the model
        need(self.kt_method != "FP8" or self.kt_weight_path is None
             or Path(self.kt_weight_path).resolve() == Path(self.model_path).resolve(), "kt-weight-path",
             "the model directory (or no flag) with --kt-method FP8: the CPU experts are read from the fp8 "
             "checkpoint, no conversion step")
        need(self.kt_method != "LLAMAFILE" or self.kt_weight_path is not None, "kt-weight-path",
             "the GGUF file (or directory of split files) holding the experts with --kt-method LLAMAFILE")
        need(self.kt_expert_placement_strategy in PLACEMENT_STRATEGIES, "kt-expert-placement-strategy",
             f"one of {PLACEMENT_STRATEGIES}")
        need(self.kt_num_gpu_experts is None or self.kt_num_gpu_experts >= 0, "kt-num-gpu-experts",
             "a non-negative integer")
        need(self.kt_gpu_experts_ratio is None or 0.0 <= self.kt_gpu_experts_ratio <= 1.0, "kt-gpu-experts-ratio",
             "a fraction between 0 and 1")
        need(self.kt_cpuinfer is None or self.kt_cpuinfer >= 1, "kt-cpuinfer", "a positive integer")
        need(self.kt_threadpool_count >= 1, "kt-threadpool-count", "a positive integer")
        if self.kt_numa_nodes is not None:
            from hybridmoe.cpu.topology import numa_nodes_problem

            spec = str(self.kt_numa_nodes)
            # the node list is expanded id by id (cpu/topology.py): "0-1000000000" took gigabytes and ended in a
            # MemoryError; ids at or above Linux's most NUMA nodes are refused before that
            ids = [d.lstrip("0") or "0" for d in re.findall(r"\d+", spec)]
            too_big = any(len(d) > 5 or int(d) >= MAX_NUMA_NODES for d in ids)
            problem = f"NUMA node ids below {MAX_NUMA_NODES}" if too_big else numa_nodes_problem(spec)
            need(problem is None, "kt-numa-nodes", problem or "")
        need(self.kt_max_deferred_experts_per_token >= 0, "kt-max-deferred-experts-per-token",
             "a non-negative integer")
        need(self.kt_gpu_prefill_token_threshold is None or self.kt_gpu_prefill_token_threshold >= 1,
             "kt-gpu-prefill-token-threshold", "a positive integer")
        # (SGLang's kt wrapper falls back to a uniform placement with a warning; asked for by name, not silently)
        need(self.kt_expert_placement_strategy != "frequency" or self.init_expert_location not in (None, "trivial"),
             "kt-expert-placement-strategy", "--init-expert-location FILE with 'frequency' (the statistics file; "
             "'trivial' holds none: --kt-expert-placement-strategy uniform places the first experts of each layer)")
        need(isinstance(self.cpu_engine, CPUEngineSettings), "cpu-engine", "a CPUEngineSettings")
        need(self.hybrid_stream_wait in ("auto", "memop", "hostfn"), "hybrid-stream-wait", "auto, memop or hostfn")
        # cross-flag rules
        split = self.kt_num_gpu_experts is not None or self.kt_gpu_experts_ratio is not None
        if not split:
            for flag, value in (("--kt-max-deferred-experts-per-token", self.kt_max_deferred_experts_per_token),
                                ("--kt-gpu-prefill-token-threshold", self.kt_gpu_prefill_token_threshold),
                                ("--kt-enable-dynamic-expert-update", self.kt_enable_dynamic_expert_update)):
                if value:
                    raise ConfigError(f"{flag} needs a GPU/CPU expert split: set --kt-num-gpu-experts (or "
                                      "--kt-gpu-experts-ratio)")
        if self.kt_enable_dynamic_expert_update and self.kt_gpu_prefill_token_threshold is None:
            raise ConfigError("--kt-enable-dynamic-expert-update needs --kt-gpu-prefill-token-threshold "
                              "(the update follows a layerwise prefill)")

    def _map_attention_backend(self) -> None:
        """SGLang's backend names run one of ours; one log line says which."""
        name = self.attention_backend
        if name is None or name in ("torch", "triton"):
            return
        ours = ATTENTION_BACKEND_ALIASES[name]
        why = ""
        if ours is None:
            import torch

            cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
            ours = "triton" if cuda else "torch"
            why = f" (hybridmoe has no {name} kernels; {ours} is the default on {'CUDA' if cuda else 'the CPU'})"
        log.info("--attention-backend %s: running hybridmoe's %s attention backend%s", name, ours, why)
        self.attention_backend = ours

    # ---- typed views (what each part of the engine receives) ----
    def cache_config(self) -> CacheConfig:
        return CacheConfig(page_size=self.page_size, max_total_tokens=self.max_total_tokens,
                           mem_fraction_static=self.mem_fraction_static, context_length=self.context_length,
                           enable_prefix_cache=not self.disable_radix_cache)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_running_requests=self.max_running_requests,
                               chunked_prefill_size=self.chunked_prefill_size,
                               max_prefill_tokens=self.max_prefill_tokens)

    def hybrid_config(self) -> HybridConfig:
        nodes = None
        if self.kt_numa_nodes is not None:
            from hybridmoe.cpu.topology import parse_node_list

            nodes = tuple(parse_node_list(str(self.kt_numa_nodes)))
        return HybridConfig(
            weight_path=self.kt_weight_path, method=self.kt_method, cpuinfer=self.kt_cpuinfer,
            threadpool_count=self.kt_threadpool_count, numa_nodes=nodes, num_gpu_experts=self.kt_num_gpu_experts,
            gpu_experts_ratio=self.kt_gpu_experts_ratio, placement_strategy=self.kt_expert_placement_strategy,
            init_expert_location=self.init_expert_location,
            max_deferred_experts_per_token=self.kt_max_deferred_experts_per_token,
            gpu_prefill_token_threshold=self.kt_gpu_prefill_token_threshold,
            dynamic_expert_update=self.kt_enable_dynamic_expert_update,
            record_expert_distribution=self.record_expert_distribution, seed=self.random_seed,
            cpu=self.cpu_engine, blocking_sync=self.hybrid_blocking_sync, stream_wait=self.hybrid_stream_wait)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's own settings (`hybridmoe serve` flags that are not engine options; the
    request and connection limits are server/limits.py's ServerLimits). Validated on construction."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # require `Authorization: Bearer <key>` (not on /health, /metrics)
    enable_metrics: bool = False
    max_queued_requests: int | None = None  # requests waiting for their first token beyond this: 503
    allowed_origins: tuple[str, ...] | None = None  # CORS origins (`*`: any); None: no CORS headers
    tool_call_parser: str | None = None  # --tool-call-parser: server/parsers/tool_formats.py's names
    reasoning_parser: str | None = None  # --reasoning-parser: server/parsers/reasoning.py's names
    # server/sampling_defaults.py: where a request's unset sampling values come from (read at startup)
    sampling_defaults: str = "model"  # model: generation_config.json on the chat routes; openai: built-in
    preferred_sampling_params: str | None = None  # JSON object: defaults for every request

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, expected: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag}: got {getattr(self, flag.replace('-', '_'))!r}, expected {expected}")

        # no whitespace or control character in a host name or address (a newline split the bind error in two)
        need(isinstance(self.host, str) and bool(self.host) and self.host.isprintable()
             and not any(c.isspace() for c in self.host), "host", "an address to listen on, e.g. 127.0.0.1")
        need(isinstance(self.port, int) and not isinstance(self.port, bool) and 0 <= self.port < 65536, "port",
             "a TCP port number (0-65535)")
        need(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)), "api-key",
             "a non-empty value (or leave the flag out)")
        # the key is compared with the Authorization header's, stripped: one with a control character or whitespace
        # at its ends could never be sent, and every request would get 401 (the message does not echo the secret)
        if self.api_key is not None and not (self.api_key.isprintable() and self.api_key == self.api_key.strip()):
            raise ConfigError("--api-key: expected printable characters without whitespace at its ends (no request "
                              "could send this key)")
        if self.allowed_origins is not None:  # a list from argparse: kept as a tuple (frozen, hashable)
            object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        need(self.allowed_origins is None or all(isinstance(o, str) and o for o in self.allowed_origins),
             "allowed-origins", "origins such as https://example.com, or *")
        q = self.max_queued_requests
        need(q is None or (isinstance(q, int) and not isinstance(q, bool) and 0 <= q <= INT_MAX),
             "max-queued-requests", f"an integer in [0, {INT_MAX}]")
        # SGLang's other names of the same formats are stored as ours (what chat_tools.py looks up)
        for field_name, canonical in (("tool_call_parser", tool_call_parser_name),
                                      ("reasoning_parser", reasoning_parser_name)):
            value = getattr(self, field_name)
            if value is None:
                continue
            flag = "--" + field_name.replace("_", "-")
            if not isinstance(value, str):
                raise ConfigError(f"{flag}: got {value!r}, expected a parser name")
            try:
                object.__setattr__(self, field_name, canonical(value))
            except ConfigError as e:
                raise ConfigError(f"{flag}: {e}") from None

    @classmethod
    def from_namespace(cls, ns: Any) -> ServerConfig:
        """From parsed `serve` flags (the attributes of the same names)."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page size, size (tokens, or a GPU memory fraction), prefix caching."""

    page_size: int = 16
    max_total_tokens: int | None = None  # None: from the memory left (GPU) or a default (CPU)
    mem_fraction_static: float | None = None  # None: 0.85
    context_length: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_cache: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and batching limits."""

    max_running_requests: int = 256
    chunked_prefill_size: int = 8192  # -1: no chunking
    max_prefill_tokens: int = 16384

    @property
    def step_tokens(self) -> int:
        """Prompt tokens per step: the chunk size, never more than max_prefill_tokens."""
        chunk = self.chunked_prefill_size if self.chunked_prefill_size > 0 else self.max_prefill_tokens
        return min(chunk, self.max_prefill_tokens)


@dataclass(frozen=True)
class HybridConfig:
    """Every `--kt-*` option (KTransformers' names without the prefix) and the CPU engine settings."""

    weight_path: str | None = None  # --kt-weight-path: CPU experts converted by `hybridmoe convert` (FP8: the model)
    method: str = "AMXINT8"
    cpuinfer: int | None = None  # CPU expert threads (None: physical cores - 1)
    threadpool_count: int = 1  # sub-pools (one per NUMA node)
    numa_nodes: tuple[int, ...] | None = None
    num_gpu_experts: int | None = None  # per MoE layer; None (and no ratio): no GPU/CPU split
    gpu_experts_ratio: float | None = None
    placement_strategy: str = "uniform"
    init_expert_location: str | None = None  # statistics file of the `frequency` strategy
    max_deferred_experts_per_token: int = 0
    gpu_prefill_token_threshold: int | None = None  # layerwise GPU prefill from this many tokens
    dynamic_expert_update: bool = False
    record_expert_distribution: str | None = None
    seed: int = 0  # of the `random` placement
    cpu: CPUEngineSettings = field(default_factory=CPUEngineSettings)
    blocking_sync: bool = True  # CUDA: read each step's result sleeping (a spinning thread takes a core)
    stream_wait: str = "auto"  # CUDA: the stream waits for a CPU task by a memory operation or a host function
    group_size: int = 128  # INT4 quantization group
    int4_symmetric: bool = True

    @property
    def converted_weights(self) -> str | None:
        """The directory of `hybridmoe convert` output to load CPU experts from (None: quantize from the
        checkpoint; FP8 always reads the checkpoint, --kt-weight-path being the model directory)."""
        return None if self.method.upper() == "FP8" else self.weight_path

    @property
    def split_requested(self) -> bool:
        """A GPU/CPU split of the routed experts was asked for (--kt-num-gpu-experts or ratio)."""
        return self.num_gpu_experts is not None or self.gpu_experts_ratio is not None


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads of a model's Hugging Face config, resolved once
    (`hybridmoe.models.registry.model_config`)."""

    hf: Any  # the transformers PretrainedConfig (models read their own fields from it)
    spec: ArchSpec  # the architecture family's description: experts, top-k, MoE layers, names
    source: str  # where the config came from (error messages)
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int  # max_position_embeddings (4096 when absent)
    # MLA (DeepSeek-V2/V3, Kimi-K2): the KV cache holds one latent vector of kv_lora_rank plus the
    # rope key of qk_rope_head_dim per token and layer, shared by all heads; 0: standard attention
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_elements_per_token(self) -> int:
        """KV cache elements one token takes in one layer (bytes: times the cache dtype's size)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def num_experts(self) -> int:
        return self.spec.num_experts

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.spec.moe_layers
