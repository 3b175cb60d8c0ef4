"""Startup of `hybridmoe serve` and `hybridmoe generate`: everything that can be checked before the
model loads (config.json, tokenizer files and chat templates, shard headers, the flags against the
model and the machine, `--kt-weight-path` against the checkpoint), and the one-line report of a failure.
The in-process API (`hybridmoe.LLM`) runs the same `prepare`.

`serve` runs `prepare` before it binds its port, so a bad model or flag never says "ready".
Oversubscribed CPU and expert options are lowered to what the machine and model have, each with
a one-line warning saying what is used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from pathlib import Path

from hybridmoe.config import ConfigError, EngineArgs, check_kt_method, check_kv_cache_dtype
from hybridmoe.engine.model_files import TOKENIZER_FILES, has_tokenizer_files
from hybridmoe.engine.request import RequestError
from hybridmoe.model_check import (
    chat_templates_of,
    check_chat_templates,
    check_tokenizer,
    check_tokens,
    check_weights,
    load_checked_config,
    one_line,
)
from hybridmoe.sizing import check_preload_bounds
from hybridmoe.weights.loader import CheckpointError

log = logging.getLogger("hybridmoe.startup")


def report_failure(prog: str, e: BaseException, debug: bool = False) -> int:
    """Print `e` as one line on stderr (the traceback first with --log-level debug); exit code 2."""
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    known = isinstance(e, (ConfigError, CheckpointError, RequestError))  # their messages name what is wrong
    msg = one_line(str(e)) if known else f"{type(e).__name__}: {one_line(str(e))}"
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return 2


# ---- oversubscription: lowered to what there is, with a warning ---------------------------------
def _node_list(args: EngineArgs) -> list[int] | None:
    if args.kt_numa_nodes is None:
        return None
    from hybridmoe.cpu.topology import parse_node_list

    return parse_node_list(str(args.kt_numa_nodes))


def cpuinfer_oversubscription(args: EngineArgs, hf_config=None) -> tuple[EngineArgs, str | None]:
    """--kt-cpuinfer above the CPUs this process may run on (those of --kt-numa-nodes if given)."""
    if args.kt_cpuinfer is None:
        return args, None
    from hybridmoe.cpu.topology import numa_nodes

    cpus = set(os.sched_getaffinity(0))
    nodes = _node_list(args)
    where = "this process may use"
    if nodes is not None:
        cpus &= {c for n in nodes for c in numa_nodes().get(n, [])}
        where = f"of NUMA node(s) {args.kt_numa_nodes} this process may use"
    have = max(1, len(cpus))
    if args.kt_cpuinfer <= have:
        return args, None
    return (dataclasses.replace(args, kt_cpuinfer=have),
            f"--kt-cpuinfer {args.kt_cpuinfer} is above the {have} CPU core(s) {where}; using {have} CPU expert "
            "thread(s) (more would share cores and slow every step)")


def threadpool_oversubscription(args: EngineArgs, hf_config=None) -> tuple[EngineArgs, str | None]:
    """--kt-threadpool-count above the NUMA nodes (one sub-pool per node)."""
    from hybridmoe.cpu.topology import numa_nodes

    nodes = _node_list(args)
    have = len(nodes) if nodes is not None else len(numa_nodes())
    if args.kt_threadpool_count <= have:
        return args, None
    return (dataclasses.replace(args, kt_threadpool_count=have),
            f"--kt-threadpool-count {args.kt_threadpool_count} is above the {have} NUMA node(s) "
            f"{'given by --kt-numa-nodes' if nodes is not None else 'of this machine'}; using {have} sub-pool(s), "
            "one per node")


def gpu_experts_oversubscription(args: EngineArgs, hf_config) -> tuple[EngineArgs, str | None]:
    """--kt-num-gpu-experts above the routed experts per MoE layer of the model."""
    from hybridmoe.models.registry import arch_spec

    n = arch_spec(hf_config).num_experts
    # (with --kt-gpu-experts-ratio the count is ignored: moe/placement.py says so when it places the experts)
    if args.kt_num_gpu_experts is None or args.kt_num_gpu_experts <= n or args.kt_gpu_experts_ratio is not None:
        return args, None
    return (dataclasses.replace(args, kt_num_gpu_experts=n),
            f"--kt-num-gpu-experts {args.kt_num_gpu_experts} is above the {n} routed experts per MoE layer of "
            f"this model; using {n} (every routed expert on the GPU, none on the CPU)")


OVERSUBSCRIPTION_CHECKS = (cpuinfer_oversubscription, threadpool_oversubscription, gpu_experts_oversubscription)


def lower_oversubscribed(args: EngineArgs, hf_config) -> EngineArgs:
    """Args with every oversubscribed option lowered, one warning logged for each."""
    for check in OVERSUBSCRIPTION_CHECKS:
        args, warning = check(args, hf_config)
        if warning:
            log.warning("%s", warning)
    return args


# ---- the checks before the model loads ----------------------------------------------------------
def check_flags_against_model(args: EngineArgs, hf_config) -> None:
    """Flags whose valid range depends on the model or on files."""
    model_max = hf_config.max_position_embeddings
    if args.context_length is not None and args.context_length > model_max:
        raise ConfigError(f"--context-length: got {args.context_length}, expected at most the model's "
                          f"max_position_embeddings {model_max} ({args.model_path}/config.json)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible to PyTorch; use --device cpu")
    check_kv_cache_dtype(args, hf_config)
    check_host_kv_cache(args, hf_config)
    location = args.init_expert_location
    if location is not None and not is_expert_location_value(location):
        try:
            found = Path(location).is_file()
        except OSError as e:  # e.g. a name longer than the file system takes
            raise ConfigError(f"--init-expert-location {location[:200]!r}: {e.strerror or e}") from None
        if not found:
            shown = location if len(location) <= 200 else location[:200] + "..."
            raise ConfigError(f"--init-expert-location {shown}: no such file")
    if args.kt_weight_path is not None and args.kt_method != "LLAMAFILE" and not Path(args.kt_weight_path).is_dir():
        raise ConfigError(f"--kt-weight-path {args.kt_weight_path}: no such directory")
    check_lora_flags(args)
    if args.record_expert_distribution is not None:
        parent = Path(args.record_expert_distribution).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"--record-expert-distribution {args.record_expert_distribution}: the directory "
                              f"{parent} does not exist")
        if Path(args.record_expert_distribution).is_dir():  # written at shutdown: that failed (IsADirectoryError) after the whole run
            raise ConfigError(f"--record-expert-distribution {args.record_expert_distribution}: is a directory, "
                              "expected the path of the statistics file to write")
        # written as FILE.tmp renamed over FILE (moe/recorder.py): a FIFO or a device there (/dev/null, as root) was
        # replaced by the statistics file at shutdown
        if Path(args.record_expert_distribution).exists() and not Path(args.record_expert_distribution).is_file():
            raise ConfigError(f"--record-expert-distribution {args.record_expert_distribution}: exists and is not a "
                              "regular file (a FIFO or device would be replaced by the statistics file)")


def check_host_kv_cache(args: EngineArgs, hf_config) -> None:
    """--max-total-tokens on the CPU: the KV cache (allocated and zeroed after the whole model load, as
    engine/model_runner.py sizes it) fits this machine's RAM. --max-total-tokens 2147483647 asked the allocator for
    hundreds of GB after the load: a RuntimeError from inside torch, or, where the kernel overcommits, a host
    swapping to death. (On a GPU the allocation fails at once with the device's out-of-memory error.)"""
    if args.max_total_tokens is None:
        return
    import torch

    from hybridmoe.engine.model_runner import resolve_device, resolve_dtype
    from hybridmoe.layers.attention.base import kv_cache_dtype
    from hybridmoe.models.config import model_config

    device = resolve_device(args.device)
    if device.type != "cpu":
        return
    m = model_config(hf_config)
    kv = kv_cache_dtype(args.kv_cache_dtype, resolve_dtype(args.dtype, hf_config, device))
    pages = -(-args.max_total_tokens // args.page_size) + 1  # + the scratch page
    need = pages * args.page_size * m.num_layers * m.kv_elements_per_token() * torch.finfo(kv).bits // 8
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > ram:
        raise ConfigError(f"--max-total-tokens {args.max_total_tokens}: a KV cache of {need / 2**30:.1f} GiB "
                          f"({str(kv).removeprefix('torch.')}, {m.num_layers} layers), more than this machine's "
                          f"{ram / 2**30:.1f} GiB of RAM")


def is_expert_location_value(value: str) -> bool:
    """--init-expert-location values that name no file, as SGLang takes them: trivial, an inline JSON object."""
    from hybridmoe.moe.expert_stats import TRIVIAL, is_inline_json

    return value == TRIVIAL or is_inline_json(value)


def check_expert_location(args: EngineArgs, spec, num_layers: int | None = None) -> None:
    """--init-expert-location, the statistics the `frequency` placement reads, against the model's layers
    (`num_layers`, num_hidden_layers: the rows of an SGLang record), MoE layers and experts (it was read after
    the whole load, and a malformed one failed with an error from deep inside)."""
    if args.kt_expert_placement_strategy != "frequency" or args.init_expert_location is None:
        return
    from hybridmoe.moe.expert_stats import load_expert_counts

    try:
        load_expert_counts(args.init_expert_location, list(spec.moe_layers), spec.num_experts, num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_lora_flags(args: EngineArgs) -> None:
    """--lora-paths and --kt-expert-lora-path name adapter directories with their files, before the model loads
    (read_adapter parses them after; a missing one found then cost the user the whole load)."""
    from hybridmoe.lora.adapter import LoRAAdapterError, check_adapter_files
    from hybridmoe.lora.setup import parse_lora_paths

    try:
        flagged = [("--lora-paths", path) for _, path in parse_lora_paths(args.lora_paths)]
    except LoRAAdapterError as e:  # a malformed value (its message names the flag)
        raise ConfigError(str(e)) from None
    if args.kt_expert_lora_path:
        flagged.append(("--kt-expert-lora-path", args.kt_expert_lora_path))
    for flag, path in flagged:
        try:
            check_adapter_files(path)
        except LoRAAdapterError as e:
            raise ConfigError(f"{flag}: {e}") from None


# the files a tokenizer directory's loaders open when present (transformers' AutoTokenizer, tokenizers)
TOKENIZER_DIR_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt")


def check_tokenizer_dir(args: EngineArgs) -> None:
    """The tokenizer directory's files are regular files, and a --tokenizer-path given has a tokenizer. A FIFO or a
    link to /dev/zero named tokenizer.json passed the checks (they skip what is not a file) and failed the load with
    transformers' "Couldn't instantiate the backend tokenizer", naming no file; `serve --tokenizer-path DIR` of a
    directory without tokenizer files started without a tokenizer, every text request then refused."""
    tok_path = Path(args.tokenizer_path or args.model_path)
    for name in TOKENIZER_DIR_FILES:
        f = tok_path / name
        if f.exists() and not f.is_file():
            raise CheckpointError(f"{f}: not a regular file (a directory, FIFO or device), expected the tokenizer "
                                  "file of that name")
    if args.tokenizer_path is not None and not has_tokenizer_files(tok_path):
        raise ConfigError(f"--tokenizer-path {tok_path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the "
                          "model's tokenizer directory, or leave the flag out (--skip-tokenizer-init: token ids only)")


def check_environment() -> None:
    """The HYBRIDMOE_* variables read while the model loads and runs (envs.py), checked before: a bad value was an
    error from deep inside the load naming no variable (CpuIsaError, OSError), or was silently ignored."""
    from hybridmoe import envs
    from hybridmoe.cpu.native import ISAS
    from hybridmoe.engine.pipeline import OVERLAP_ENV

    isa = envs.cpu_isa()
    if isa is not None and isa not in ISAS:
        raise ConfigError(f"${envs.CPU_ISA}={os.environ[envs.CPU_ISA]!r}: expected one of {', '.join(ISAS)} (or leave "
                          "it unset)")
    lib = envs.cpu_lib()
    if lib is not None and not lib.is_file():
        raise ConfigError(f"${envs.CPU_LIB}={str(lib)!r}: not a file (the native CPU library to load; or leave it unset)")
    try:  # each raises ValueError naming its variable
        envs.pin_caller(), envs.align_large("grid"), envs.moe_direct(), envs.router_fused(), envs.handoff_fused()
        envs.hugepages(), envs.amx_inline(), envs.lora_fused()
    except ValueError as e:
        raise ConfigError(f"${e}") from None
    overlap = os.environ.get(OVERLAP_ENV, "")
    if overlap not in ("", "0", "1"):  # engine/pipeline.py ignores any other value
        raise ConfigError(f"${OVERLAP_ENV}={overlap!r}: expected 0 or 1 (or leave it unset)")


def prepare(args: EngineArgs) -> EngineArgs:
    """Runs every startup check; the args to start with (oversubscribed values lowered).
    Raises ConfigError or CheckpointError with a one-line message."""
    check_environment()
    config, spec = load_checked_config(args.model_path, args.trust_remote_code)
    check_flags_against_model(args, config)
    check_preload_bounds(args, config, spec)  # after it: it refuses --device cuda without a GPU first
    check_expert_location(args, spec, getattr(config, "num_hidden_layers", None))
    size = None
    tok_path = args.tokenizer_path or args.model_path
    if not args.skip_tokenizer_init:
        size = check_tokenizer(tok_path, args.trust_remote_code)
        check_tokenizer_dir(args)
        # the model's chat templates, where the tokenizer carries them (--chat-template replaces them all: it was
        # compiled by EngineArgs.validate, and a broken template of the model's must not stop its way out)
        if args.chat_template is None and has_tokenizer_files(tok_path):
            check_chat_templates(tok_path)
    check_tokens(config, args.model_path, tok_path, size)
    if args.load_format != "dummy":
        check_weights(args.model_path, config, spec)
    check_kt_method(args.kt_method, config, f"{args.model_path}/config.json")
    if args.kt_method == "LLAMAFILE":  # GGUF experts: layer count, names, shapes and types
        from hybridmoe.gguf.experts import open_for_model

        open_for_model(args.kt_weight_path, config, spec, model_path=args.model_path)  # GGUFError is a ConfigError naming file and tensor
    elif args.kt_weight_path is not None and args.kt_method != "FP8":  # the manifest, the method, the fingerprint
        from hybridmoe.weights.cpu_format import CPUWeightDir

        CPUWeightDir(args.kt_weight_path).check_model(config, args.model_path, args.kt_method, spec)
    return lower_oversubscribed(args, config)


def check_text_input(args: EngineArgs, prog: str, chat: bool = False) -> None:
    """What a command that tokenizes text (`generate` and its --prompt) needs of the model, checked before it
    loads (the error came after the whole load): a tokenizer, and with `chat` (--chat) a chat template."""
    tok_path = args.tokenizer_path or args.model_path
    if args.skip_tokenizer_init:
        raise ConfigError(f"--skip-tokenizer-init: `{prog}` tokenizes its --prompt text, which needs the tokenizer; "
                          "leave the flag out")
    if not has_tokenizer_files(tok_path):  # (a GGUF's view directory always has them: gguf/view.py)
        where = f"--tokenizer-path {tok_path}" if args.tokenizer_path else tok_path
        raise ConfigError(f"{where}: no tokenizer files ({', '.join(TOKENIZER_FILES)}), and `{prog}` tokenizes its "
                          "--prompt text: pass --tokenizer-path with the model's tokenizer directory")
    if chat and args.chat_template is None and not chat_templates_of(tok_path):
        from hybridmoe.gguf.view import gguf_source

        raise ConfigError(f"--chat: {gguf_source(tok_path) or tok_path} has no chat template (chat_template in "
                          "tokenizer_config.json, or chat_template.jinja): pass --chat-template FILE_OR_NAME (e.g. "
                          "chatml), or leave --chat out")


# ---- the startup summary (after the model loaded) -----------------------------------------------
def _layer_runs(counts: dict[int, int]) -> list[tuple[int, int, int]]:
    """(first layer, last layer, GPU experts) of each run of consecutive MoE layers with one count."""
    runs: list[tuple[int, int, int]] = []
    for layer, n in sorted(counts.items()):
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], layer, n)
        else:
            runs.append((layer, layer, n))
    return runs


def _cpu_side(runner) -> str:
    """The CPU expert engine's method, threads, sub-pools and ISA path."""
    cfg = runner.moe.hybrid_cfg
    pool = runner.moe.options.pool
    threads = f"{pool.threads} threads in {pool.subpools} sub-pool(s)" if pool is not None else "no pool"
    try:
        from hybridmoe.cpu.native import resolve_isa

        isa = resolve_isa()
    except Exception as e:  # noqa: BLE001  (the summary never fails the startup)
        isa = f"unknown ({type(e).__name__})"
    return f"--kt-method {cfg.method}, {threads}, ISA path {isa}"


def summary_lines(engine) -> list[str]:
    """What runs where, once the model is loaded: model, architecture, dtype, context, KV pages, the
    experts' placement (per MoE layer), the CPU engine, deferral, layerwise prefill and CUDA graphs."""
    runner, args = engine.runner, engine.args
    cfg = engine.hf_config
    arch = (getattr(cfg, "architectures", None) or [getattr(cfg, "model_type", "?")])[0]
    kv = engine.kv
    spec = engine.model_config.spec
    dtype = str(runner.dtype).removeprefix("torch.")
    lines = [f"model {args.model_path} ({arch}, {dtype} on {runner.device}), context length {engine.context_len}",
             f"KV cache: {kv.num_pages - 1} pages of {kv.page_size} tokens ({kv.capacity_tokens} tokens), "
             f"prefix cache {'on' if kv.enable_prefix_cache else 'off'}; attention backend "
             f"{type(runner.attn_backend).__name__}"]
    moe, n_layers, n_exp = runner.moe, len(spec.moe_layers), spec.num_experts
    placement = moe.placement
    if placement is not None:
        hcfg = moe.hybrid_cfg
        counts = {layer: placement.gpu_experts(layer) for layer in placement.moe_layers}
        for first, last, n in _layer_runs(counts):
            where = f"MoE layer {first}" if first == last else f"MoE layers {first}-{last}"
            lines.append(f"experts: {where}: {n} of {n_exp} on the GPU ({placement.gpu_backend}), {n_exp - n} on "
                         f"the CPU; placement {hcfg.placement_strategy}")
        lines.append(f"CPU experts: {_cpu_side(runner)}; deferred per token {placement.num_deferred}")
        if placement.prefill_threshold is not None:
            lines.append(f"layerwise prefill from {placement.prefill_threshold} tokens"
                         + ("; hot experts move to the GPU after each (--kt-enable-dynamic-expert-update)"
                            if placement.dynamic_update else ""))
    elif moe.backend == "cpu":
        lines.append(f"experts: all {n_exp} of each of {n_layers} MoE layers on the CPU")
        lines.append(f"CPU experts: {_cpu_side(runner)}; deferred per token 0")
    else:
        lines.append(f"experts: all {n_exp} of each of {n_layers} MoE layers on the {runner.device.type} "
                     f"({moe.backend} backend)")
    graphs = runner.graphs
    lines.append(f"CUDA graphs: batch sizes {graphs.sizes}" if graphs is not None else "CUDA graphs: off")
    pre = getattr(runner, "prefill_graphs", None)
    if pre is not None:
        lines.append(f"prefill CUDA graphs: {pre.sizes} new tokens in up to {pre.max_seqs} sequences")
    if hasattr(engine, "overlap"):
        lines.append("overlap scheduling: " + ("on (--disable-overlap-schedule turns it off)" if engine.overlap
                                                 else "off"))
    return lines


def log_summary(engine) -> None:
    """Log the startup summary, one INFO line per item."""
    for line in summary_lines(engine):
        log.info("%s", line)
