"""Hybrid decode throughput: a full-size MoE model with random weights, N experts per layer on the
GPU and the rest on the CPU engine (default: Qwen3-30B-A3B shape, 32 GPU experts, AMXINT8;
--dummy-deepseek-v3 / --dummy-kimi-k2: those published configs, --layers N of them: shapes.py).

For each deferral setting, CUDA graphs on and off, and each batch size, prints decode tokens/s and
where a step's time goes: CPU busy (the CPU expert tasks' wall time, from the native profile) and
the rest of the step (GPU work not hidden behind the CPU, transfers, launches). For batch 1 also
the bound = the CPU pool's stream-read bandwidth measured in the same run / the CPU expert bytes a
token reads (expected number of CPU-resident experts among its top-k, times the packed bytes of
one expert, over all MoE layers), and the ratio to it; at the end the same ratio to the bound from
the best of the run's probes (one at the start, one after every batch-1 row), the conservative one.
Every row also carries the CPU engine's trace summary (hybridmoe/cpu/trace.py: the pool's idle
time before each task, split into waiting for the submit and start latency, and how long after a
task ends the stream's wait returns and the next task is submitted); batch-1 rows print it.
The host's read bandwidth drifts (probes of one run range from ~90 to ~165 GB/s on the H200 host),
so batch-1 rows also give the ratio to the bound from the two probes around the row, and
`--repeat N` runs the grid N times interleaved and prints each setting's median.

    python benchmarks/bench_hybrid_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, parse_shape_args, start_decode, write_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridmoe.cpu.engine import FUSE_MODES  # noqa: E402
from hybridmoe.cpu.settings import CPUEngineSettings  # noqa: E402


def cpu_expert_bytes_per_token(model, topk: int) -> tuple[float, int]:
    """(expected CPU expert bytes per token, packed bytes of one CPU expert)."""
    total, per_expert = 0.0, 0
    for block in model.moe_blocks():
        ex = block.experts
        cpu = getattr(ex, "cpu", None)
        if cpu is None:
            continue
        packed = cpu.layer.packed
        nbytes = sum(t.numel() * t.element_size() for t in packed.tensors().values())
        per_expert = nbytes // packed.num_experts
        e_total = ex.gpu_local.numel()
        total += topk * packed.num_experts / e_total * per_expert
    return total, per_expert


def run_batch(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    from hybridmoe.cpu import native
    from hybridmoe.cpu.engine import default_pool
    from hybridmoe.cpu.trace import summarize

    eng = llm.engine
    reqs = start_decode(llm, batch, prompt_len, steps, vocab)
    native.profile(reset=True)
    default_pool().sync()
    default_pool().trace_start(1 << 19)  # submit/start/end/wait times of every CPU task (~50 ns each)
    t0, n, nsteps = time.perf_counter(), 0, 0
    while not all(r.finished for r in reqs):
        n += len(eng.step())
        nsteps += 1
    dt = time.perf_counter() - t0
    default_pool().sync()
    trace = summarize(default_pool().trace_stop())
    prof = native.profile(reset=True)
    cpu_busy = sum(v for k, v in prof.items() if k != "tasks")
    return {"tokens_per_s": n / dt, "ms_per_step": 1e3 * dt / nsteps, "cpu_busy_ms_per_step": 1e3 * cpu_busy / nsteps,
            "other_ms_per_step": 1e3 * (dt - cpu_busy) / nsteps, "cpu_tasks_per_step": prof["tasks"] / nsteps,
            "cpu_trace": trace}


def extrapolation_target(a: argparse.Namespace, n_moe: int) -> int | None:
    """MoE layers to extrapolate to: --extrapolate-moe-layers, else the published model's with --dummy-*."""
    if a.extrapolate_moe_layers is not None:
        return a.extrapolate_moe_layers or None
    name = getattr(a, "dummy_model", None)
    if name is None:
        return None
    from shapes import DUMMY_MODELS

    cfg = DUMMY_MODELS[name]
    full = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    return full if full != n_moe else None


def extrapolate(row: dict, n_moe: int, target: int) -> dict:
    """The step of a model with `target` MoE layers where this one has n_moe: the measured step plus the missing
    layers at the median period of a layer within a step (releases of the stream, one a MoE layer). The dense layers,
    the lm_head and the step boundary are counted once, as in the real model. Ratios to a bound scale the bytes by
    target / n_moe."""
    period = row["cpu_trace"].get("release_interval_us", float("nan"))
    if not period == period or n_moe < 2:  # nan: no releases traced (no CPU tasks)
        return {}
    ms = row["ms_per_step"] + (target - n_moe) * period / 1e3
    out = {"layer_period_us": period, "extrapolated_moe_layers": target, "extrapolated_ms_per_step": ms,
           "extrapolated_tokens_per_s": row["batch"] * 1e3 / ms}
    if "adjacent_probes_gbps" in row:
        adjacent = statistics.fmean(row["adjacent_probes_gbps"]) * 1e9
        out["extrapolated_ratio_to_adjacent_bound"] = out["extrapolated_tokens_per_s"] * row[
            "cpu_expert_bytes_per_token"] * target / n_moe / adjacent
    return out


def gguf_experts(a, where: Path) -> str:
    """The GGUF of --gguf TYPE experts for this shape (written unless `where` has it already)."""
    from gguf_experts_file import write_experts_gguf

    cfg = getattr(a, "dummy_config", None)
    moe_layers = list(range(cfg["first_k_dense_replace"] if cfg else 0, a.layers))
    path = where / f"experts-{a.gguf}-L{a.layers}-E{a.experts}-H{a.hidden}-I{a.inter}.gguf"
    if not path.exists():
        where.mkdir(parents=True, exist_ok=True)
        arch = "deepseek2" if cfg else "qwen3moe"
        write_experts_gguf(path.with_suffix(".part"), a.gguf, a.layers, moe_layers, a.experts, a.hidden, a.inter,
                           arch=arch)
        path.with_suffix(".part").rename(path)
    return str(path)


def _int_list(v: str) -> list[int]:
    """An argparse type: a comma list of ints."""
    try:
        return [int(x) for x in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {v!r}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--gpu-experts", type=int, default=32, help="--kt-num-gpu-experts")
    p.add_argument("--method", default="AMXINT8", help="--kt-method")
    p.add_argument("--cpuinfer", type=int, default=None, help="--kt-cpuinfer (default: the library's)")
    p.add_argument("--deferred", type=int, nargs="+", default=[0, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--graphs", default="on,off")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="overlap scheduling (the next step launched before this one's tokens are read); auto: the "
                        "engine's default (on with CUDA)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--off-steps", type=int, default=16, help="decode steps with graphs off (slow)")
    p.add_argument("--batched-steps", type=int, default=32, help="decode steps with graphs on at batch > 1")
    p.add_argument("--blocking-sync", default="on", choices=["on", "off"],
                   help="read each step's result sleeping (on: the engine's default) or spinning; fixed for the "
                        "run (EngineArgs.hybrid_blocking_sync)")
    p.add_argument("--hostfn-spin-us", type=int, default=CPUEngineSettings().hostfn_spin_us,
                   help="CPUEngineSettings.hostfn_spin_us: host-function waits spin this long before sleeping "
                        "(-1: the pool's spin); fixed for the run (the CPU pool's setting)")
    p.add_argument("--fuse", default="on", type=lambda v: v.split(","), metavar="on[,off,reduce,quant]",
                   help="CPUThreadPool.fuse_mode for the batch-1 rows, each value in turn (on,off: an A/B in one "
                        "process): a one-token task's weighted sum inside its down phase (reduce), its activation "
                        "conversion inside its gate/up phase (quant), both (on, the default) or neither (off)")
    p.add_argument("--block-prefetch", default=[1], type=_int_list, metavar="1[,0]",
                   help="CPUThreadPool.block_prefetch for the batch-1 rows, each value in turn (GGUF experts: 0 none, "
                        "1 the next block's rows towards L2, the default; 2 towards L1)")
    p.add_argument("--items-per-thread", default=[8], type=_int_list, metavar="8[,4,2]",
                   help="CPUThreadPool.items_per_thread for the batch-1 rows, each value in turn (a decode task's "
                        "items sized for about that many a thread; default 8)")
    p.add_argument("--prefetch", default=None, type=_int_list, metavar="4096[,2048]",
                   help="CPUThreadPool.prefetch_bytes for the batch-1 rows, each value in turn (the decode kernels' "
                        "software prefetch distance; default: CPUEngineSettings' for this CPU)")
    p.add_argument("--stream-wait", default=["auto"], type=lambda v: v.split(","), metavar="auto[,hostfn,memop]",
                   help="how the stream waits for a CPU task, each value in turn (graphs captured again for each): "
                        "a host function (hostfn) or the GPU polling the task's done word (memop); auto (the "
                        "default, as the engine's EngineArgs.hybrid_stream_wait) is memop where the driver has it")
    p.add_argument("--merge-deferred", default=["on"], type=lambda v: v.split(","), metavar="on[,off]",
                   help="with --stream-wait memop and deferral: a one-token layer's task and its deferred one as one "
                        "native task (on, the default) or two (off), each value in turn (graphs captured again)")
    p.add_argument("--handoff", default=["on"], type=lambda v: v.split(","), metavar="on[,off]",
                   help="CUDA: a layer hands over to its CPU task and back by handoff_triton.py's two kernels (on, "
                        "the default) or by copies and small kernels (off), each value in turn (graphs captured again)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole grid this many times, interleaved (the host's bandwidth drifts); the "
                        "summary gives each setting's median")
    p.add_argument("--extrapolate-moe-layers", type=int, default=None,
                   help="also give each row's time per step extrapolated to this many MoE layers (default: the "
                        "published model's with --dummy-*, e.g. 58 for DeepSeek-V3): the measured step plus the "
                        "missing layers at the median period of a layer within a step (the CPU trace's interval "
                        "between stream releases), and its ratio to the bound of that many layers")
    p.add_argument("--gguf", default=None, metavar="TYPE",
                   help="serve the routed experts from a GGUF file of random TYPE blocks (Q4_K, Q8_0, ...: "
                        "--kt-method LLAMAFILE --kt-weight-path, written to --gguf-dir first; "
                        "gguf_experts_file.py); --method is then ignored")
    p.add_argument("--gguf-dir", default=None,
                   help="where --gguf writes its file (default: the run's temporary directory); an existing file "
                        "of the same name is reused")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tests), not a measurement")
    p.add_argument("--out", default=None)
    a = parse_shape_args(p)
    if not a.fuse or any(v not in FUSE_MODES for v in a.fuse):
        p.error(f"--fuse {','.join(a.fuse)}: a comma list of {', '.join(FUSE_MODES)}")
    if not a.block_prefetch or any(v not in (0, 1, 2) for v in a.block_prefetch):
        p.error(f"--block-prefetch {a.block_prefetch}: a comma list of 0, 1, 2")
    if not a.items_per_thread or any(not 1 <= v <= 64 for v in a.items_per_thread):
        p.error(f"--items-per-thread {a.items_per_thread}: a comma list of 1..64")
    if a.prefetch is not None and (not a.prefetch or any(not 0 <= v <= 1 << 20 for v in a.prefetch)):
        p.error(f"--prefetch {a.prefetch}: a comma list of byte distances in [0, 1 MiB]")
    if not a.stream_wait or any(v not in ("auto", "hostfn", "memop") for v in a.stream_wait):
        p.error(f"--stream-wait {','.join(a.stream_wait)}: a comma list of auto, hostfn, memop")
    if not a.merge_deferred or any(v not in ("on", "off") for v in a.merge_deferred):
        p.error(f"--merge-deferred {','.join(a.merge_deferred)}: a comma list of on, off")
    if not a.handoff or any(v not in ("on", "off") for v in a.handoff):
        p.error(f"--handoff {','.join(a.handoff)}: a comma list of on, off")
    if a.gguf:
        from hybridmoe.cpu.gguf_quant import TYPE_IDS

        if a.gguf.upper() not in TYPE_IDS:
            p.error(f"--gguf {a.gguf}: not a type the GGUF kernels compute ({', '.join(sorted(TYPE_IDS))})")
        a.gguf = a.gguf.upper()

    from hybridmoe import LLM
    from hybridmoe.cpu.engine import default_pool
    from hybridmoe.moe.runtime import check_stream_wait

    # "auto" named as what it resolves to here, so rows say which wait ran and merging (memop only) applies
    a.stream_wait = list(dict.fromkeys(check_stream_wait(w, torch.device(a.device)) for w in a.stream_wait))
    from hybridmoe.cpu.trace import format_summary

    results = {"shape": vars(a), "runs": []}
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        max_bs = max(a.batch)
        method, weight_path = a.method, None
        if a.gguf:
            method, weight_path = "LLAMAFILE", gguf_experts(a, Path(a.gguf_dir or d))
        t = time.perf_counter()
        cuda = a.device == "cuda"
        llm = LLM(d, device=a.device, dtype="bfloat16" if cuda else "float32", load_format="dummy", progress=False,
                  skip_tokenizer_init=True, kt_method=method, kt_weight_path=weight_path,
                  kt_num_gpu_experts=a.gpu_experts,
                  kt_cpuinfer=a.cpuinfer, kt_max_deferred_experts_per_token=a.deferred[0],
                  cpu_engine=CPUEngineSettings(hostfn_spin_us=a.hostfn_spin_us),
                  hybrid_blocking_sync=a.blocking_sync == "on", hybrid_stream_wait=a.stream_wait[0],
                  enable_overlap_schedule=a.overlap == "on", disable_overlap_schedule=a.overlap == "off",
                  disable_cuda_graph="on" not in a.graphs, cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                  max_total_tokens=max_bs * (a.prompt_len + a.steps + 64), context_length=4096)
        print(f"model ready in {time.perf_counter() - t:.1f} s", flush=True)
        runner = llm.engine.runner
        bw = default_pool().stream_read_gbps() * 1e9
        probes = [bw / 1e9]  # one more after every batch-1 row: the machine's read bandwidth moves
        bpt, per_expert = cpu_expert_bytes_per_token(runner.model, a.topk)
        bound = bw / bpt
        n_moe = sum(1 for b in runner.model.moe_blocks() if getattr(b.experts, "cpu", None) is not None)
        target = extrapolation_target(a, n_moe)
        print(f"CPU stream read {bw / 1e9:.1f} GB/s; CPU expert bytes/token {bpt / 1e9:.3f} GB "
              f"({per_expert / 1e6:.2f} MB per expert) -> bound {bound:.1f} tok/s", flush=True)
        onoff = {True: "on", False: "off"}
        current = (runner.hybrid.num_deferred, runner.hybrid.stream_wait, onoff[runner.hybrid.merge_deferred],
                   onoff[runner.hybrid.fused_handoff] if cuda else "none")
        grid = [(rep, d, w, m, h) for rep in range(a.repeat) for d in a.deferred for w in a.stream_wait
                for m in (a.merge_deferred if d and w == "memop" else ["on"])  # merging needs both
                for h in (a.handoff if cuda else ["none"])]  # (the kernels run on CUDA only)
        for rep, deferred, wait, merge, handoff in grid:
            want = (deferred, wait, merge, handoff)
            if want != current:  # same model, other setting: tasks rebuilt, graphs captured again
                runner.graphs = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                runner.hybrid.set_num_deferred(deferred)
                runner.hybrid.set_stream_wait(wait)
                runner.hybrid.set_merge_deferred(merge == "on")
                runner.hybrid.set_fused_handoff(handoff == "on")
                if "on" in a.graphs:
                    runner.capture_graphs()
                current = want
            graphs = runner.graphs
            for mode in a.graphs.split(","):
                if mode == "on" and graphs is None:
                    continue
                runner.graphs = graphs if mode == "on" else None
                spin = default_pool().native_settings().hostfn_spin_us  # what the pool got from the config
                blocking = "on" if llm.engine.sampler.wait_event is not None else "off"  # as the config set it
                pf0 = results["prefetch_bytes_default"] = default_pool().prefetch_bytes  # the settings' default here
                for b, fr, bp, ipt, pf in [(bs, f, q, n, d) for bs in a.batch for f in (a.fuse if bs == 1 else ["on"])
                                           for q in (a.block_prefetch if bs == 1 else [1])
                                           for n in (a.items_per_thread if bs == 1 else [8])
                                           for d in (a.prefetch or [pf0] if bs == 1 else [pf0])]:
                    default_pool().fuse_mode, default_pool().block_prefetch = fr, bp
                    default_pool().items_per_thread, default_pool().prefetch_bytes = ipt, pf
                    steps = a.off_steps if mode == "off" else a.steps if b == 1 else a.batched_steps
                    row = {"rep": rep, "deferred": deferred, "stream_wait": wait, "merge_deferred": merge,
                           "handoff": handoff, "graphs": mode, "batch": b,
                           "steps": steps, "blocking_sync": blocking, "hostfn_spin_us": spin, "fuse": fr,
                           "block_prefetch": bp, "items_per_thread": ipt, "prefetch_bytes": pf,
                           **run_batch(llm, b, a.prompt_len, steps, a.vocab)}
                    default_pool().fuse_mode, default_pool().block_prefetch = "on", 1
                    default_pool().items_per_thread, default_pool().prefetch_bytes = 8, pf0
                    if b == 1:
                        before = probes[-1]
                        probes.append(default_pool().stream_read_gbps())
                        # the host's bandwidth drifts: the probes just before and after this row
                        adjacent = (before + probes[-1]) / 2
                        row.update(stream_read_gbps=bw / 1e9, cpu_expert_bytes_per_token=bpt,
                                   bound_tokens_per_s=bound, ratio_to_bound=row["tokens_per_s"] / bound,
                                   adjacent_probes_gbps=[before, probes[-1]],
                                   ratio_to_adjacent_bound=row["tokens_per_s"] * bpt / (adjacent * 1e9))
                    if target:
                        row.update(extrapolate(row, n_moe, target))
                    results["runs"].append(row)
                    if a.out:  # after every row: a later setting that fails keeps the earlier ones
                        Path(a.out).write_text(json.dumps(results, indent=2))
                    extra = (f"  bound {bound:.0f}, ratio {row['ratio_to_bound']:.2f} (adjacent probes "
                             f"{row['ratio_to_adjacent_bound']:.2f})") if b == 1 else ""
                    bl = "" if blocking == "on" else f" blocking-sync {blocking:3s}"
                    bl += "" if fr == "on" else f" fuse {fr}"
                    bl += "" if bp == 1 else f" bp {bp}"
                    bl += "" if ipt == 8 else f" ipt {ipt}"
                    bl += "" if pf == pf0 else f" pf {pf}"
                    bl += "" if wait == "hostfn" else f" wait {wait}"
                    bl += "" if merge == "on" else " unmerged"
                    bl += "" if handoff != "off" else " handoff off"
                    print(f"deferred {deferred} graphs {mode:3s}{bl} batch {b:3d}: {row['tokens_per_s']:8.1f} tok/s "
                          f"{row['ms_per_step']:7.2f} ms/step (CPU busy {row['cpu_busy_ms_per_step']:.2f}, "
                          f"other {row['other_ms_per_step']:.2f}){extra}", flush=True)
                    if b == 1:
                        print(f"  CPU trace: {format_summary(row['cpu_trace'])}", flush=True)
                    if "extrapolated_ms_per_step" in row:
                        print(f"  extrapolated to {target} MoE layers: {row['extrapolated_ms_per_step']:.2f} ms/step "
                              f"({row['extrapolated_tokens_per_s']:.2f} tok/s; a layer's period "
                              f"{row['layer_period_us']:.1f} us)", flush=True)
            runner.graphs = graphs
        llm.shutdown()
    # conservative: the bound from the best probe of the run (the first one can read low)
    best = max(probes)
    results["stream_probes_gbps"] = probes
    groups: dict[tuple, list[dict]] = {}
    for row in results["runs"]:
        if row["batch"] == 1:
            row["ratio_to_best_probe_bound"] = row["tokens_per_s"] * bpt / (best * 1e9)
            if "extrapolated_tokens_per_s" in row:
                row["extrapolated_ratio_to_best_probe_bound"] = (row["extrapolated_tokens_per_s"] * bpt * target / n_moe
                                                                 / (best * 1e9))
        key = tuple(row[k] for k in ("deferred", "graphs", "batch", "blocking_sync", "hostfn_spin_us", "fuse",
                                     "block_prefetch", "items_per_thread", "stream_wait", "merge_deferred", "handoff",
                                     "prefetch_bytes"))
        groups.setdefault(key, []).append(row)
    print(f"best probe of the run {best:.1f} GB/s -> bound {best * 1e9 / bpt:.1f} tok/s; probes "
          f"{', '.join(f'{v:.0f}' for v in probes)}")
    results["summary"] = []
    for key, rows in groups.items():
        med = statistics.median(r["tokens_per_s"] for r in rows)
        entry = dict(zip(("deferred", "graphs", "batch", "blocking_sync", "hostfn_spin_us", "fuse", "block_prefetch",
                          "items_per_thread", "stream_wait", "merge_deferred", "handoff", "prefetch_bytes"), key),
                     runs=len(rows),
                     median_tokens_per_s=med,
                     tokens_per_s=[r["tokens_per_s"] for r in rows])
        line = (f"deferred {key[0]} graphs {key[1]:3s} batch {key[2]:3d} blocking-sync {key[3]:3s} "
                f"hostfn-spin {key[4]} fuse {key[5]} bp {key[6]} ipt {key[7]} wait {key[8]} merge {key[9]} "
                f"handoff {key[10]} pf {key[11]}: median "
                f"{med:.1f} tok/s of {len(rows)} "
                f"({', '.join(f'{v:.1f}' for v in entry['tokens_per_s'])})")
        if target and key[2] == 1:
            ext = statistics.median(r["extrapolated_tokens_per_s"] for r in rows)
            entry[f"median_extrapolated_tokens_per_s_{target}_moe_layers"] = ext
            entry["median_extrapolated_ratio_to_best_probe_bound"] = ext * bpt * target / n_moe / (best * 1e9)
            entry["median_extrapolated_ratio_to_adjacent_bound"] = statistics.median(
                r["extrapolated_ratio_to_adjacent_bound"] for r in rows)
        if key[2] == 1:
            entry["median_ratio_to_best_probe_bound"] = med * bpt / (best * 1e9)
            entry["median_ratio_to_adjacent_bound"] = statistics.median(r["ratio_to_adjacent_bound"] for r in rows)
            line += (f"; ratio {entry['median_ratio_to_best_probe_bound']:.2f} of the best-probe bound, "
                     f"{entry['median_ratio_to_adjacent_bound']:.2f} of the adjacent-probe bound")
        if "median_extrapolated_ratio_to_best_probe_bound" in entry:
            line += (f"; extrapolated to {target} MoE layers: {ext:.2f} tok/s, ratio "
                     f"{entry['median_extrapolated_ratio_to_best_probe_bound']:.2f} of the best-probe bound, "
                     f"{entry['median_extrapolated_ratio_to_adjacent_bound']:.2f} of the adjacent-probe bound")
        results["summary"].append(entry)
        print(line)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
