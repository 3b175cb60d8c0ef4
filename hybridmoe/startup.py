"""Startup of `hybridmoe serve` and `hybridmoe generate`: everything that can be checked before the
model loads (config.json, tokenizer files, shard headers, the flags against the model and the
machine, `--kt-weight-path` against the checkpoint), and the one-line report of a failure.

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

from hybridmoe.config import ConfigError, EngineArgs, check_kt_method
from hybridmoe.model_check import check_tokenizer, check_tokens, check_weights, load_checked_config, one_line
from hybridmoe.weights.loader import CheckpointError

log = logging.getLogger("hybridmoe.startup")


def report_failure(prog: str, e: BaseException, debug: bool = False) -> int:
    """Print `e` as one line on stderr (the traceback first with --log-level debug); exit code 2."""
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    known = isinstance(e, (ConfigError, CheckpointError))
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
    if args.kt_num_gpu_experts is None or args.kt_num_gpu_experts <= n:
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
    if args.init_expert_location is not None and not Path(args.init_expert_location).is_file():
        raise ConfigError(f"--init-expert-location {args.init_expert_location}: no such file")
    if args.kt_weight_path is not None and not Path(args.kt_weight_path).is_dir():
        raise ConfigError(f"--kt-weight-path {args.kt_weight_path}: no such directory")
    if args.record_expert_distribution is not None:
        parent = Path(args.record_expert_distribution).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"--record-expert-distribution {args.record_expert_distribution}: the directory "
                              f"{parent} does not exist")


def prepare(args: EngineArgs) -> EngineArgs:
    """Runs every startup check; the args to start with (oversubscribed values lowered).
    Raises ConfigError or CheckpointError with a one-line message."""
    config, spec = load_checked_config(args.model_path, args.trust_remote_code)
    check_flags_against_model(args, config)
    size = None
    tok_path = args.tokenizer_path or args.model_path
    if not args.skip_tokenizer_init:
        size = check_tokenizer(tok_path, args.trust_remote_code)
    check_tokens(config, args.model_path, tok_path, size)
    if args.load_format != "dummy":
        check_weights(args.model_path, config, spec)
    check_kt_method(args.kt_method, config, f"{args.model_path}/config.json")
    if args.kt_method == "LLAMAFILE":  # GGUF experts: layer count, names, shapes and types
        from hybridmoe.gguf.experts import open_for_model

        open_for_model(args.kt_weight_path, config, spec)  # GGUFError is a ConfigError naming file and tensor
    elif args.kt_weight_path is not None and args.kt_method != "FP8":  # the manifest, the method, the fingerprint
        from hybridmoe.weights.cpu_format import CPUWeightDir

        CPUWeightDir(args.kt_weight_path).check_model(config, args.model_path, args.kt_method, spec)
    return lower_oversubscribed(args, config)
