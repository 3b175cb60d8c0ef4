"""CPU-only decode at batch 1 (device="cpu", every routed expert on the CPU engine), as a ratio to the
bandwidth bound, and llama.cpp on the same shape in the same run.

    python benchmarks/bench_cpu_decode.py --layers 6                  # Qwen3-30B-A3B shape, 6 layers
    python benchmarks/bench_cpu_decode.py --tiny --no-llama --out r.json   # smoke test (CI)

Bound = bytes one token reads (every non-expert matrix, top-k packed experts per MoE layer, one
embedding row, and the KV cache of the positions so far: negligible at the default --prompt-len) / the
stream-read bandwidth of the engine's pool measured in the same run.
hybridmoe and llama.cpp (`-ngl 0`, Q8_0 experts, F16 rest: llama_cpp_ref.py; skipped when
llama-cpp-python is not installed) alternate for --repeats rounds; medians are printed. Random weights
(`--load-format dummy`: experts drawn directly in packed form), so only speed is compared. Sets
OMP_WAIT_POLICY=PASSIVE (unless set): torch then takes every core beside the expert pool.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see engine/model_runner.py
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, parse_shape_args, start_decode, write_config  # noqa: E402

TINY = ["--layers", "2", "--experts", "8", "--topk", "2", "--hidden", "128", "--inter", "64", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "32", "--vocab", "512"]


def token_bytes(model, topk: int, dense_linears=None) -> int:
    """Weight bytes one decode token reads (see the module docstring); a linear with an int8 copy
    (--dense-weights int8) counts that copy's bytes instead of its bf16 weight's."""
    total = 0
    for name, p in model.named_parameters():
        total += p.shape[1] * p.element_size() if "embed_tokens" in name else p.numel() * p.element_size()
    for mod in model.modules():
        q8 = dense_linears.int8_of(mod) if dense_linears is not None and hasattr(dense_linears, "int8_of") else None
        if q8 is not None:
            total += q8.nbytes - mod.weight.nbytes
    for block in model.moe_blocks():
        experts = block.experts
        packed = getattr(getattr(experts, "layer", None), "packed", None)
        if packed is None:  # a torch backend: its expert parameters are counted above, whole
            continue
        per_expert = sum(t.nbytes for t in packed.tensors().values()) // packed.num_experts
        total += topk * per_expert
    return total


DENSE_MODES = ("on", "pin", "nopin", "classic", "attn2", "layers", "nomoe", "bf16", "pinned", "pinned0", "unfused",
               "queued", "dense", "off")


def decode_and_prefill(llm, prompt_len: int, steps: int, vocab: int) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of one request at batch 1: bench_decode.decode_tps, with the prefill
    (start_decode: the prompt and the first decode step) timed too, on an empty prefix cache (start_decode
    sends the same prompt every time: from the second round on it was a cache hit, 20x "faster")."""
    if not llm.engine.flush_cache():
        raise RuntimeError("the engine is busy: its prefix cache could not be flushed before the prefill")
    t0 = time.perf_counter()
    reqs = start_decode(llm, 1, prompt_len, steps, vocab)
    t1 = time.perf_counter()
    eng, n = llm.engine, 0
    while not all(r.finished for r in reqs):
        n += len(eng.step())
    return n / (time.perf_counter() - t1), prompt_len / (t1 - t0)


def kv_bytes_per_token(model, prompt_len: int, steps: int) -> int:
    """KV-cache bytes one decode token's attention reads, averaged over the timed steps (positions
    prompt_len .. prompt_len + steps - 1): every standard attention layer's k and v rows of every
    position so far. Negligible at the default prompt length; at long contexts part of the bound."""
    from hybridmoe.layers.attention.layer import Attention

    per_pos = sum(2 * m.num_kv_heads * m.head_dim * 2 for m in model.modules() if isinstance(m, Attention))  # bf16
    return int(per_pos * (prompt_len + (steps - 1) / 2))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every physical core)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--dense", default="on,off",
                   help="modes alternating per round, the first one reported: on (the CPU-only path's native dense "
                        "linears, hybridmoe/cpu/dense_linears.py, and decode attention, cpu/attn_decode.py, each layer's "
                        "attention half and MoE block in one call, cpu/layer_decode.py, every layer in one stacked call where the "
                        "model allows, and greedy argmax; each decode step on the pool leader's CPU where HYBRIDMOE_PIN_CALLER=1, "
                        "cpu/caller_pin.py), pin (on, each step pinned), nopin (on, never pinned: the default), classic (on, every pool phase waiting for all threads: "
                        "before session 16 dynamic phases did not skip threads that joined late), pfN (on, with the "
                        "kernels' software prefetch distance N bytes, e.g. pf0, pf8192), attn2 (on, with the AVX2 decode "
                        "attention kernel where the AVX-512 one is the default), layers (on with one call per layer, not "
                        "stacked), nomoe (on "
                        "with the MoE block in Python after the one-call layer: routing, CPUExperts, the task), "
                        "bf16 (on, with --dense-weights int8: the bf16 weights, for an A/B in one process; the bound "
                        "still counts the int8 bytes), pinned (nopin, with the calling thread pinned to the pool leader's CPU for the "
                        "round: a caller sharing a core with a pinned spinning pool thread slowed a 10 us attention call "
                        "to 78 us on the 2-core machine), pinned0 (pinned, and the pool's leader thread sleeps as soon as its task queue is "
                        "empty instead of spinning on that CPU: the AMX path queues each layer's MoE task to it), unfused (on without the one-call layers), queued (on, but every pool call handed to the pool's leader thread and "
                        "waited for, not run on the caller), dense (the dense linears and argmax only), off (none: "
                        "torch's ops)")
    p.add_argument("--split", action="store_true",
                   help="after the rounds, one instrumented run per mode: where a decode step's time goes "
                        "(decode_split.py; JSON key 'split')")
    p.add_argument("--dense-weights", default="bf16", choices=["bf16", "int8"],
                   help="--cpu-dense-weights: the attention projections and LM head as bf16 or int8 copies (then the "
                        "bound counts the int8 bytes, and llama.cpp's GGUF holds those matrices in Q8_0 too)")
    p.add_argument("--gguf", default=None, help="reuse / keep the GGUF at this path (written to match --dense-weights "
                                                "when missing; an existing one is used as it is)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape, 1 repeat of 4 steps (smoke test)")
    p.add_argument("--out", default=None)
    raw = sys.argv[1:] if argv is None else argv
    a = parse_shape_args(p, (TINY + ["--steps", "4", "--repeats", "1", "--prompt-len", "8"] + raw)
                         if "--tiny" in raw else raw)
    bad = [m for m in a.dense.split(",") if m not in DENSE_MODES and not (m.startswith("pf") and m[2:].isdigit())]
    if bad:
        p.error(f"--dense: unknown mode(s) {', '.join(bad)}; choose from {', '.join(DENSE_MODES)} or pfN")
    if a.layers == 48 and "--layers" not in raw:
        a.layers = 6  # the model: 6 layers of Qwen3-30B-A3B (the full depth does not fit 23 GB)

    from hybridmoe import LLM
    from hybridmoe.cpu.engine import default_pool
    from hybridmoe.cpu.topology import physical_cores

    threads = a.threads or len(physical_cores())
    res: dict = {"shape": {k: v for k, v in vars(a).items() if k != "dummy_config"}, "threads": threads}
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        t0 = time.perf_counter()
        llm = LLM(d, device="cpu", dtype="bfloat16", load_format="dummy", progress=False, skip_tokenizer_init=True,
                  kt_method=a.method, kt_num_gpu_experts=0, kt_cpuinfer=threads, max_running_requests=1,
                  max_total_tokens=4 * (a.prompt_len + a.steps + 64), context_length=max(4096, a.prompt_len + a.steps + 64),
                  **({"cpu_dense_weights": a.dense_weights} if a.dense_weights != "bf16" else {}))
        res["load_s"] = time.perf_counter() - t0
        print(f"hybridmoe: model ready in {res['load_s']:.1f} s ({a.layers} layers, {a.method}, {threads} threads)",
              flush=True)
        bpt_w = token_bytes(llm.engine.runner.model, a.topk, getattr(llm.engine.runner, "dense_linears", None))
        bpt_kv = kv_bytes_per_token(llm.engine.runner.model, a.prompt_len, a.steps)
        bpt = bpt_w + bpt_kv
        pool = default_pool()
        llama = None
        if not a.no_llama:
            from llama_cpp_ref import LlamaCpp, available, write_gguf

            why = available()
            if why:
                print(f"llama.cpp skipped: {why}")
                res["llama_skipped"] = why
            else:
                gg = Path(a.gguf) if a.gguf else Path(d) / "model.gguf"
                if not gg.exists():
                    t0 = time.perf_counter()
                    write_gguf(gg, a, dense_q8=a.dense_weights == "int8")
                    print(f"GGUF written in {time.perf_counter() - t0:.1f} s ({gg.stat().st_size / 1e9:.2f} GB)")
                llama = LlamaCpp(gg, threads, n_ctx=max(1024, a.prompt_len + a.steps + 64))
        dl = getattr(llm.engine.runner, "dense_linears", None)  # None: no native dense linears in this build
        ad = getattr(llm.engine.runner, "attn_decode", None)
        ld = getattr(llm.engine.runner, "layer_decode", None)
        try:
            from hybridmoe.cpu.dense import NATIVE_ARGMAX as native_argmax
        except ImportError:  # a build without it
            native_argmax = None
        modes = [m for m in a.dense.split(",") if dl is not None or m == "off"] or ["off"]
        res["dense_modes"] = modes
        res["thread_layout"] = {"pool_threads": pool.threads, "pool_cpus": pool.cpus,
                                "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                                "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        print(f"threads: pool {pool.threads} on cpus {pool.cpus}, torch {torch.get_num_threads()}, "
              f"os.cpu_count {os.cpu_count()}", flush=True)

        pf_default = getattr(pool, "prefetch_bytes", None)

        def set_mode(m: str) -> None:
            # pfN: on, with the kernels' software prefetch distance N bytes (pool.prefetch_bytes) this round
            pf = int(m[2:]) if m.startswith("pf") and m[2:].isdigit() else None
            if pf_default is not None:
                pool.prefetch_bytes = pf_default if pf is None else pf
            if pf is not None:
                m = "on"
            if attn_kernel is not None:  # attn2: on, with the AVX2 decode attention span kernel
                attn_decode.set_kernel("avx2" if m == "attn2" else attn_kernel)
            if m == "attn2":
                m = "on"
            if dl is not None:
                dl.enabled = m in ("on", "bf16", "nomoe", "unfused", "queued", "dense", "layers", "pinned", "pinned0", "pin",
                                  "nopin", "classic")
                if hasattr(dl, "int8_enabled"):
                    dl.int8_enabled = m != "bf16"
            if ad is not None:
                ad.enabled = m in ("on", "bf16", "nomoe", "unfused", "queued", "layers", "pinned", "pinned0", "pin", "nopin", "classic")
            if ld is not None:
                ld.enabled = m in ("on", "bf16", "nomoe", "queued", "layers", "pinned", "pinned0", "pin", "nopin", "classic")
                ld.moe_enabled = m != "nomoe"
                ld.stack_enabled = m != "layers"
            pool.run_inline = m != "queued"
            if hasattr(pool, "dynamic_phases"):
                pool.dynamic_phases = m != "classic"
            if native_argmax is not None:
                native_argmax[0] = m != "off"
            # pinned: this (calling) thread on the pool leader's CPU for the round, where it leads the
            # inline phases in the leader's place; else anywhere the process may run (as the engine runs)
            if cp is not None:  # off first: it restores the leader spin it set
                cp.enabled = False
            os.sched_setaffinity(0, {pool.cpus[0]} if m in ("pinned", "pinned0") and pool.cpus else free_cpus)
            pool.leader_spin_us = 0 if m == "pinned0" else -1
            if cp is not None:  # each decode step on the leader's CPU (the engine's with HYBRIDMOE_PIN_CALLER=1)
                cp.enabled = m == "pin" or (cp_default and m not in ("nopin", "pinned", "pinned0"))
        from hybridmoe.cpu import attn_decode

        attn_kernel = attn_decode.set_kernel("auto") if ad is not None else None  # the default, restored per round
        free_cpus = os.sched_getaffinity(0)
        cp = getattr(llm.engine.runner, "caller_pin", None)
        cp_default = cp is not None and cp.enabled
        res["caller_pin_default"] = cp_default
        print(f"caller pin: {'on' if cp_default else 'off'} by default"
              + (f" (leader CPU {cp.cpu})" if cp is not None else " (not installed)"), flush=True)
        hm, ll, bw, ll_prefill = [], [], [], []
        by_mode: dict[str, list[float]] = {m: [] for m in modes}
        load_by_mode: dict[str, list] = {m: [] for m in modes}
        prefill_by_mode: dict[str, list[float]] = {m: [] for m in modes}  # prompt tokens / s of each round's prefill
        res["prefill_tokens_per_s_by_mode"] = prefill_by_mode
        res["cpu_load_by_mode"] = load_by_mode  # per round: (others' share, steal share) of every CPU, or None
        for r in range(a.repeats):
            bw.append(pool.stream_read_gbps(256 << 20 if a.tiny else 1 << 30, 5) * 1e9)
            line = f"round {r}: stream read {bw[-1] / 1e9:.1f} GB/s"
            for m in modes:
                set_mode(m)
                c0 = cpu_ticks()
                tps, ptps = decode_and_prefill(llm, a.prompt_len, a.steps, a.vocab)
                by_mode[m].append(tps)
                prefill_by_mode[m].append(ptps)
                load = others_load(c0, cpu_ticks())
                load_by_mode[m].append(load)
                line += f", hybridmoe ({m}) {by_mode[m][-1]:.2f} tok/s"
                if load is not None:  # the machine's CPU time outside this process, and stolen by the hypervisor
                    line += f" [others {load[0]:.0%}, steal {load[1]:.0%}]"
            if len(modes) > 1:  # the same round's speeds side by side: this machine's bandwidth swings
                line += " (" + ", ".join(f"{m}/{modes[0]} {by_mode[m][-1] / by_mode[modes[0]][-1]:.3f}"
                                         for m in modes[1:]) + ")"
            hm.append(by_mode[modes[0]][-1])
            if llama is not None:
                ll.append(llama.decode_tps(a.prompt_len, a.steps, a.vocab, seed=r))
                ll_prefill.append(a.prompt_len / llama.last_prefill_s)
                line += f", llama.cpp {ll[-1]:.2f} tok/s"
            line += f"; prefill ({modes[0]}) {prefill_by_mode[modes[0]][-1]:.1f} tok/s" + (
                f", llama.cpp {ll_prefill[-1]:.1f}" if ll_prefill else "")
            print(line, flush=True)
        if a.split:
            res["split"] = run_split(llm, a, modes, set_mode, statistics.median(bw))
        llm.shutdown()
        if llama is not None:
            llama.close()
    bw_m, hm_m = statistics.median(bw), statistics.median(hm)
    bound = bw_m / bpt
    res.update(bytes_per_token=bpt, weight_bytes_per_token=bpt_w, kv_bytes_per_token=bpt_kv, stream_read_bps=bw_m, bound_tokens_per_s=bound, tokens_per_s=hm_m,
               ratio_to_bound=hm_m / bound, rounds={"stream_read_bps": bw, "hybridmoe": hm, "llama_cpp": ll},
               by_dense_mode={m: {"rounds": v, "tokens_per_s": statistics.median(v),
                                  "ratio_to_bound": statistics.median(v) / bound} for m, v in by_mode.items()})
    print(f"weights per token {bpt_w / 1e9:.3f} GB + KV cache {bpt_kv / 1e9:.4f} GB, stream read {bw_m / 1e9:.1f} GB/s (median): bound {bound:.2f} tok/s")
    for m, v in by_mode.items():
        # per round against that round's bandwidth too: on a shared machine both move together
        per = [t * bpt / b for t, b in zip(v, bw)]
        res["by_dense_mode"][m]["ratio_per_round"] = per
        print(f"mode {m}: {statistics.median(v):.2f} tok/s = {statistics.median(v) / bound:.2f} of the bound "
              f"(rounds {min(v):.2f}-{max(v):.2f}; per-round ratios {' '.join(f'{r:.2f}' for r in per)}, "
              f"median {statistics.median(per):.2f})")
        if m != modes[0]:  # against the first mode round by round (both ran within the same minute)
            vs = [x / y for x, y in zip(v, by_mode[modes[0]])]
            res["by_dense_mode"][m]["vs_first_per_round"] = vs
            print(f"  {m} / {modes[0]} per round: {' '.join(f'{x:.3f}' for x in vs)}, median {statistics.median(vs):.3f}")
    print(f"hybridmoe CPU-only decode: {hm_m:.2f} tok/s = {hm_m / bound:.2f} of the bound")
    if ll:
        res["llama_cpp_tokens_per_s"] = statistics.median(ll)
        print(f"llama.cpp: {res['llama_cpp_tokens_per_s']:.2f} tok/s; hybridmoe / llama.cpp = "
              f"{hm_m / res['llama_cpp_tokens_per_s']:.2f}")
    pf = statistics.median(res["prefill_tokens_per_s_by_mode"][modes[0]])
    res["prefill_tokens_per_s"] = pf
    line = f"prefill of {a.prompt_len} tokens (with the first decode step): hybridmoe ({modes[0]}) {pf:.1f} tok/s"
    if ll_prefill:
        res["llama_cpp_prefill_tokens_per_s"] = statistics.median(ll_prefill)
        line += f", llama.cpp {res['llama_cpp_prefill_tokens_per_s']:.1f} tok/s (its prompt in batches of 512)"
    print(line)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return res


def cpu_ticks() -> tuple[list[int], float] | None:
    """/proc/stat's aggregate CPU ticks (user nice system idle iowait irq softirq steal) and this process's
    CPU seconds (every thread), or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    t = os.times()
    return [int(v) for v in fields[1:9]], t.user + t.system


def others_load(a, b) -> tuple[float, float] | None:
    """(share of all CPUs busy outside this process, share stolen by the hypervisor) between two
    cpu_ticks() readings: a round slowed by other work on a shared host says so."""
    if a is None or b is None:
        return None
    d = [y - x for x, y in zip(a[0], b[0])]
    total = sum(d)
    if total <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = total - d[3] - d[4] - d[7]  # not idle, not iowait, not stolen
    mine = (b[1] - a[1]) * hz
    return max(0.0, busy - mine) / total, d[7] / total


def run_split(llm, a, modes: list[str], set_mode, bw: float) -> dict:
    """One instrumented decode run per mode (decode_split.py): per-step time by category."""
    from decode_split import DecodeSplit, print_split

    split, out = DecodeSplit(llm), {}
    try:
        for m in modes:
            set_mode(m)
            reqs = start_decode(llm, 1, a.prompt_len, a.steps, a.vocab)
            split.start()
            n = 0
            while not all(r.finished for r in reqs):
                llm.engine.step()
                n += 1
            out[m] = split.stop(n, bw)
            print_split(out[m], f"(mode {m})")
    finally:
        split.remove()
    return out


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
