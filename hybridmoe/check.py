"""`hybridmoe check`: what this machine offers the server, and the flags to start it with.

Reports CPU model, cores, NUMA nodes, RAM, the instruction sets the CPU expert kernels use, the
native CPU library (variant, whether it loads), GPUs, and library versions; then recommends
--kt-method, --kt-cpuinfer and --kt-threadpool-count. Exit 0 when the server can run here, 1
with the reasons when it cannot.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

ISA_FLAGS = {  # report name -> /proc/cpuinfo flag
    "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX-512 F": "avx512f", "AVX-512 BW": "avx512bw",
    "AVX-512 VNNI": "avx512_vnni", "AVX-512 BF16": "avx512_bf16", "AMX tile": "amx_tile", "AMX int8": "amx_int8",
    "AMX bf16": "amx_bf16",
}
REQUIRED_MODULES = ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "safetensors", "tokenizers")
MIN_PYTHON = (3, 10)


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _parse_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            out.extend(range(int(a), int(b or a) + 1))
    return out


def cpu_info() -> dict[str, Any]:
    """Model name, logical and physical cores, NUMA nodes and ISA flags (Linux /proc and /sys)."""
    text = _read("/proc/cpuinfo")
    model, flags = platform.processor() or platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    logical = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in logical:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        cores.add((_read(topo / "physical_package_id").strip() or "?", _read(topo / "core_id").strip() or str(cpu)))
    nodes = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = _parse_list(_read(d / "cpulist"))
        if cpus:
            nodes[int(d.name[4:])] = cpus
    return {"model": model, "arch": platform.machine(), "logical_cpus": len(logical),
            "physical_cores": len(cores) or len(logical), "numa_nodes": max(1, len(nodes)),
            "numa_cpus": {str(k): v for k, v in nodes.items()},
            "isa": {name: flag in flags for name, flag in ISA_FLAGS.items()}}


def memory_info() -> dict[str, float]:
    """Total and available RAM in GiB (/proc/meminfo)."""
    values: dict[str, float] = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            values[key] = int(rest.split()[0]) / 2**20
    return {"total_gib": round(values.get("MemTotal", 0.0), 1), "available_gib": round(values.get("MemAvailable", 0.0), 1)}


def native_info() -> dict[str, Any]:
    """The native CPU expert library: found/loaded, its best ISA path and the paths it can run."""
    try:
        from hybridmoe.cpu import native  # type: ignore[attr-defined]
    except Exception as e:  # the package is not built or is absent in this version
        return {"status": "not built", "detail": f"{type(e).__name__}: {e}"}
    try:
        path = _native_library_path(native)
        if path is None:
            stale = native._packaged_path() is not None
            return {"status": "not built", "detail": "the compiled library is older than its sources; run "
                    "`pip install -e .`" if stale else "no compiled library; run `pip install -e .`"}
        native.lib()
        return {"status": "loads", "path": str(path), "variant": native.best_isa(),
                "available": native.available_isas()}
    except Exception as e:
        return {"status": "does not load", "detail": f"{type(e).__name__}: {e}"}


def _native_library_path(native: Any) -> Path | None:
    """Where the library would be loaded from, without compiling it (None when absent)."""
    from hybridmoe import envs

    env = envs.cpu_lib()
    if env is not None:
        return env
    packaged = native._packaged_path()
    if packaged is not None and not native._stale(packaged):
        return packaged
    build = native._build
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridmoe" / build.sources_digest()
    target = cache / build.lib_filename()
    return target if target.exists() else None


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:
        return None


def gpu_info() -> dict[str, Any]:
    """CUDA availability, version and each GPU's name and memory (via torch)."""
    try:
        import torch
    except Exception as e:
        return {"available": False, "detail": f"torch does not import: {e}"}
    info: dict[str, Any] = {"cuda_build": torch.version.cuda, "available": torch.cuda.is_available(), "devices": []}
    if info["available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                    "capability": f"{p.major}.{p.minor}"})
        from hybridmoe.cuda_driver import stream_memops_supported

        # how the hybrid stream waits for the CPU experts (--hybrid-stream-wait auto)
        info["stream_memops"] = stream_memops_supported()
    return info


def recommend(cpu: dict[str, Any], native: dict[str, Any], hf_config: Any = None) -> dict[str, Any]:
    """Recommended hybrid flags for this machine (and model, when given)."""
    from hybridmoe.sizing import recommend_method

    method, _ = recommend_method(cpu["isa"], hf_config)
    return {"--kt-method": method, "--kt-cpuinfer": max(1, cpu["physical_cores"] - 1),
            "--kt-threadpool-count": cpu["numa_nodes"]}


def collect() -> dict[str, Any]:
    """The whole report, plus `problems` (the server cannot run) and `warnings`."""
    cpu, mem, native, gpu = cpu_info(), memory_info(), native_info(), gpu_info()
    versions = {"python": platform.python_version(), "hybridmoe": _version("hybridmoe")}
    versions.update({m: _version(m) for m in ("torch", "triton", "transformers", "fastapi", "uvicorn")})
    problems, warnings = [], []
    if sys.version_info < MIN_PYTHON:
        problems.append(f"Python {platform.python_version()} is too old; need >= {'.'.join(map(str, MIN_PYTHON))}")
    for m in REQUIRED_MODULES:
        if _version(m) is None:
            problems.append(f"the required package `{m}` does not import")
    if not (cpu["isa"]["AVX2"] and cpu["isa"]["FMA"]):
        warnings.append("no AVX2+FMA: CPU-resident experts cannot run here (use --device cpu or all experts on GPU)")
    if native["status"] != "loads":
        warnings.append(f"the native CPU expert library {native['status']}: CPU experts use the slower torch path")
    if not gpu.get("available"):
        warnings.append("no CUDA GPU: only --device cpu is available")
    if mem["available_gib"] and mem["available_gib"] < 2:
        warnings.append(f"only {mem['available_gib']} GiB of RAM available")
    return {"cpu": cpu, "memory": mem, "native_cpu_library": native, "gpu": gpu, "versions": versions,
            "recommended_flags": recommend(cpu, native), "problems": problems, "warnings": warnings}


def format_report(r: dict[str, Any]) -> str:
    cpu, mem, nat, gpu = r["cpu"], r["memory"], r["native_cpu_library"], r["gpu"]
    yes = {True: "yes", False: "no"}
    lines = [f"CPU            {cpu['model']} ({cpu['arch']})",
             f"cores          {cpu['physical_cores']} physical, {cpu['logical_cpus']} logical, "
             f"{cpu['numa_nodes']} NUMA node(s)",
             f"RAM            {mem['total_gib']} GiB total, {mem['available_gib']} GiB available",
             "ISA            " + ", ".join(f"{k} {yes[v]}" for k, v in cpu["isa"].items())]
    native = nat["status"] + (f" (variant {nat['variant']}; can run {', '.join(nat['available'])})"
                              if nat["status"] == "loads" else f" ({nat.get('detail', '')})")
    lines.append(f"native CPU lib {native}")
    if gpu.get("available"):
        for i, d in enumerate(gpu["devices"]):
            lines.append(f"GPU {i}          {d['name']}, {d['memory_gib']} GiB, compute {d['capability']}")
    else:
        lines.append("GPU            none (CUDA not available)")
    lines.append(f"CUDA (torch)   {gpu.get('cuda_build') or 'not built with CUDA'}")
    if "stream_memops" in gpu:
        lines.append("CPU->GPU wait  " + ("memory operations (--hybrid-stream-wait auto: memop)" if gpu["stream_memops"]
                                          else "host functions (this driver has no stream memory operations)"))
    lines.append("versions       " + ", ".join(f"{k} {v or 'not installed'}" for k, v in r["versions"].items()))
    lines.append("recommended    " + " ".join(f"{k} {v}" for k, v in r["recommended_flags"].items()))
    lines.append(f"why            {r['method_reason']}")
    for side, counts in (r.get("gguf_tensor_types") or {}).items():
        lines.append(f"GGUF {side:<9} " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    for line in (r.get("sizing") or {}).get("lines", []):
        lines.append(f"sizing         {line}")
    if r.get("command"):
        lines.append(f"command        {r['command']}")
    lines += [f"warning        {w}" for w in r["warnings"]]
    lines += [f"PROBLEM        {p}" for p in r["problems"]]
    lines.append("result         " + ("the server can run here" if not r["problems"] else "the server cannot run here"))
    return "\n".join(lines)


def add_model_sizing(report: dict[str, Any], ns: argparse.Namespace) -> None:
    """With --model: the method for that checkpoint, the largest --kt-num-gpu-experts that fits the
    GPU (or --gpu-memory-gib), and a ready `hybridmoe serve` command line."""
    from hybridmoe.config import ConfigError, check_kt_method
    from hybridmoe.gguf.paths import is_gguf_model
    from hybridmoe.model_check import load_checked_config
    from hybridmoe.sizing import GiB, gpu_total_bytes, recommend_method, size_gpu_experts

    if is_gguf_model(ns.model):  # the method follows from the file's expert types (gguf/method_report.py)
        from hybridmoe.gguf.method_report import gguf_method
        from hybridmoe.gguf.view import gguf_view

        method, why, report["gguf_tensor_types"] = gguf_method(ns.model)
        config, spec = load_checked_config(str(gguf_view(ns.model)), flag="--model")
    else:
        config, spec = load_checked_config(ns.model, flag="--model")
        method, why = recommend_method(report["cpu"]["isa"], config)
    if ns.context_length is not None and ns.context_length > config.max_position_embeddings:  # as serve refuses it
        raise ConfigError(f"--context-length: got {ns.context_length}, expected at most the model's "
                          f"max_position_embeddings {config.max_position_embeddings}")
    if ns.kt_method:
        check_kt_method(ns.kt_method, config, f"{ns.model}/config.json")  # FP8 of a checkpoint that is not: as serve
        method, why = ns.kt_method.upper(), f"--kt-method {ns.kt_method.upper()} as given"
    gpu = int(ns.gpu_memory_gib * GiB) if ns.gpu_memory_gib else gpu_total_bytes()
    s = size_gpu_experts(config, spec, gpu, mem_fraction=ns.mem_fraction_static, context_len=ns.context_length,
                         kv_tokens=ns.max_total_tokens, kt_method=method)
    flags = dict(report["recommended_flags"], **{"--kt-method": method, "--kt-num-gpu-experts": s.num_gpu_experts})
    report["recommended_flags"], report["method_reason"] = flags, why
    report["sizing"] = {"num_gpu_experts": s.num_gpu_experts, "num_experts": s.num_experts,
                        "gpu_budget_gib": None if s.gpu_budget is None else round(s.gpu_budget / GiB, 2),
                        "plan_gib": round(s.plan_gib, 2), "lines": s.lines}
    extra = [f"--context-length {ns.context_length}"] if ns.context_length else []
    extra += [f"--max-total-tokens {ns.max_total_tokens}"] if ns.max_total_tokens else []
    extra += [f"--mem-fraction-static {ns.mem_fraction_static}"] if ns.mem_fraction_static else []
    report["command"] = " ".join([f"hybridmoe serve --model-path {ns.model}", *(f"{k} {v}" for k, v in flags.items()),
                                  *extra])


# the flags that size a model (meaningful with --model only): (dest, flag)
_MODEL_FLAGS = (("context_length", "--context-length"), ("max_total_tokens", "--max-total-tokens"),
                ("mem_fraction_static", "--mem-fraction-static"), ("gpu_memory_gib", "--gpu-memory-gib"),
                ("kt_method", "--kt-method"))
MAX_GPU_GIB = float(1 << 20)  # a GPU of more than 1 PiB is a typo (and 1e300 GiB overflowed the byte count)


def check_flag_values(ns: argparse.Namespace) -> str | None:
    """What is wrong with the sizing flags (one line naming the flag), or None. They were used as given: a negative
    GPU or context sized nonsense with exit code 0, --gpu-memory-gib inf was an OverflowError traceback."""
    from hybridmoe.config import INT_MAX

    if ns.model == "":  # Path("") is the current directory
        return "--model: got '', expected a model directory or a GGUF file"
    if ns.model is None:
        given = [flag for dest, flag in _MODEL_FLAGS if getattr(ns, dest) is not None]
        if given:
            return f"{given[0]}: sizes the experts of --model; give --model DIR (or leave {given[0]} out)"
        return None
    for dest, flag in (("context_length", "--context-length"), ("max_total_tokens", "--max-total-tokens")):
        v = getattr(ns, dest)
        if v is not None and not 1 <= v <= INT_MAX:
            return f"{flag}: got {v}, expected a positive integer (at most {INT_MAX})"
    f = ns.mem_fraction_static
    if f is not None and not (math.isfinite(f) and 0 < f < 1):
        return f"--mem-fraction-static: got {f}, expected a fraction between 0 and 1"
    g = ns.gpu_memory_gib
    if g is not None and not (math.isfinite(g) and 0 < g <= MAX_GPU_GIB):
        return f"--gpu-memory-gib: got {g}, expected a positive number of GiB (at most {MAX_GPU_GIB:.0f})"
    return None


def check_main(argv: list[str] | None = None) -> int:
    """`hybridmoe check [--json] [--model DIR ...]`: print the report; 0 when the server can run here, else 1."""
    from hybridmoe.args import OneLineParser, kt_method_arg
    from hybridmoe.config import KT_METHODS
    from hybridmoe.model_check import one_line

    # OneLineParser: a flag error is one line naming the flag (argparse's own printed the usage block first)
    p = OneLineParser(prog="hybridmoe check", description="environment report and recommended flags")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="a model directory (config.json is enough) or a GGUF file: size its experts for this "
                        "machine (a GGUF: the method its expert types call for)")
    p.add_argument("--context-length", type=int, default=None, help="with --model: context to size for "
                   "(default: the model's max_position_embeddings)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="with --model: KV cache budget in tokens (default: one full context)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="with --model: GPU share (default 0.85)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="with --model: size for a GPU of this many GiB instead of the one here")
    p.add_argument("--kt-method", default=None, type=kt_method_arg, metavar="{" + ",".join(KT_METHODS) + "}",
                   help="with --model: size for this method instead of the recommended")
    ns = p.parse_args(argv)
    problem = check_flag_values(ns)
    if problem:
        p.error(problem)
    report = collect()
    from hybridmoe.sizing import recommend_method

    report["method_reason"] = recommend_method(report["cpu"]["isa"])[1]
    if ns.model is not None:
        from hybridmoe.config import ConfigError
        from hybridmoe.weights.loader import CheckpointError

        try:
            add_model_sizing(report, ns)
        except (ConfigError, CheckpointError, ValueError) as e:  # GGUF path errors are ValueErrors
            print(f"hybridmoe check: error: {one_line(str(e))}", file=sys.stderr)  # (a path may hold a newline)
            return 2
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(check_main())
