"""What expert LoRA costs the native CPU MoE task at decode sizes: the same tasks with and without the
rank-R adapter slots in use, per ISA path and thread count, interleaved (one round = every setting
once; --rounds of them; medians).

Default: the Qwen3-30B-A3B shape (H=2048, I=768, top-8) with 6 of each token's 8 experts on the CPU
(2 ids -1: GPU-resident), INT8 experts (AMXINT8), rank 16, T = 1 (one adapter) and T = 4 (four
tokens on four adapters), bf16 x and out as the engine gives them. Tasks rotate over --layers
layers of --experts experts with fresh random routing, so weights are not cache-resident. Each
row: the median task time without LoRA (base) and with it, their ratio, and the bytes ceiling of
that ratio (1 + the adapter bytes the task reads / the expert bytes it reads), the same from the 10th
percentile of each setting's task times (the least disturbed tasks on a shared machine), and the
native profile's "lora" time per task (the LoRA work outside the GEMM phases).

    python benchmarks/bench_cpu_lora.py --isa avx512,avx2 --threads 1,2 --out cpu_lora.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridmoe.cpu import native  # noqa: E402
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool  # noqa: E402
from hybridmoe.cpu.quant import pack_layer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_moe import clone_layer, expert_bytes  # noqa: E402


def routing(t: int, e: int, k: int, on_cpu: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, k] ids: `on_cpu` distinct experts per token, the rest -1 (the GPU's), and weights."""
    ids = torch.full((t, k), -1, dtype=torch.int32)
    for r in range(t):
        ids[r, :on_cpu] = torch.randperm(e, generator=g)[:on_cpu].int()
    return ids, torch.rand(t, k, generator=g)


def time_tasks(pool: CPUThreadPool, tasks: list) -> tuple[float, float]:
    """(median, 10th percentile) seconds from submit to done over the prebuilt tasks (the low
    percentile: the tasks least disturbed by other processes on a shared machine)."""
    times = []
    for task, keep in tasks:
        s = time.perf_counter()
        pool.sync(pool.submit(task, keep))
        times.append(time.perf_counter() - s)
    times.sort()
    return statistics.median(times), times[len(times) // 10]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--isa", default="avx512,avx2")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--T", default="1,4")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--on-cpu", type=int, default=6, help="experts of each token on the CPU")
    p.add_argument("--experts", type=int, default=32, help="experts per layer (the CPU share)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tasks", type=int, default=24, help="tasks per setting and round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    isas, threads, ts = a.isa.split(","), [int(v) for v in a.threads.split(",")], [int(v) for v in a.T.split(",")]
    h, i, e, r, k = a.hidden, a.inter, a.experts, a.rank, a.topk
    g = torch.Generator().manual_seed(0)
    base = pack_layer(torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5,
                      a.method)
    packs = [base] + [clone_layer(base) for _ in range(a.layers - 1)]
    ebytes = expert_bytes(base)
    pools = {n: CPUThreadPool(threads=n) for n in threads}
    slots = max(ts)
    layers: dict[tuple[str, int], list[CPUMoELayer]] = {}
    for isa in isas:
        for n in threads:
            ls = []
            for pk in packs:
                layer = CPUMoELayer(pk, isa=isa, pool=pools[n])
                layer.attach_lora(0, slots, r, torch.bfloat16)
                for s in range(slots):
                    ad = [(torch.randn(e, *shape, generator=g) * 0.05).bfloat16()
                          for shape in ((r, h), (i, r), (r, h), (i, r), (r, i), (h, r))]
                    layer.set_lora_slot(0, s, *ad, 2.0)
                ls.append(layer)
            layers[(isa, n)] = ls
    lora_bytes = 3 * r * (h + i) * 2  # bf16 A and B of gate, up, down (unpadded) per (expert, slot)

    def build(isa: str, n: int, t: int, lora: bool, seed: int) -> tuple[list, float]:
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(t, h, generator=gg).bfloat16()
        out = torch.empty(t, h, dtype=torch.bfloat16)
        idx = torch.arange(t, dtype=torch.int32) if lora else None  # token j on slot j
        tasks, ratio = [], []
        for j in range(a.tasks):
            ids, w = routing(t, e, k, a.on_cpu, gg)
            tasks.append(layers[(isa, n)][j % a.layers].make_task(x, ids, w, out, lora_idx=idx))
            pairs = {(int(ids[row, c]), row) for row in range(t) for c in range(k) if ids[row, c] >= 0}
            ratio.append(1 + len(pairs) * lora_bytes / (len({p[0] for p in pairs}) * ebytes))
        return tasks, statistics.mean(ratio)

    settings = [(isa, n, t) for isa in isas for n in threads for t in ts]
    times: dict[tuple, list[float]] = {(s, lo): [] for s in settings for lo in (False, True)}
    lows: dict[tuple, list[float]] = {(s, lo): [] for s in settings for lo in (False, True)}
    lora_us: dict[tuple, list[float]] = {s: [] for s in settings}
    gemm_us: dict[tuple, list[tuple[float, float]]] = {(s, lo): [] for s in settings for lo in (False, True)}
    ceilings = {}
    for rnd in range(a.rounds + 1):  # round 0: warm-up, not kept
        for s in settings:
            for lo in (False, True):
                tasks, ceil = build(*s, lo, seed=rnd * 1000 + s[2])
                if lo:
                    ceilings[s] = ceil
                native.profile(reset=True)
                med, low = time_tasks(pools[s[1]], tasks)
                prof = native.profile(reset=True)
                if rnd:
                    n_t = max(1.0, prof["tasks"])
                    gemm_us[(s, lo)].append((1e6 * prof["gemm1"] / n_t, 1e6 * prof["gemm2"] / n_t))
                    times[(s, lo)].append(med)
                    lows[(s, lo)].append(low)
                    if lo:
                        lora_us[s].append(1e6 * prof["lora"] / max(1.0, prof["tasks"]))
    rows = []
    for s in settings:
        b, lo = statistics.median(times[(s, False)]), statistics.median(times[(s, True)])
        ratios = [y / x for x, y in zip(times[(s, False)], times[(s, True)])]
        bl, ll = min(lows[(s, False)]), min(lows[(s, True)])
        row = {"isa": s[0], "threads": s[1], "T": s[2], "base_us": 1e6 * b, "lora_us": 1e6 * lo,
               "ratio": statistics.median(ratios), "base_low_us": 1e6 * bl, "lora_low_us": 1e6 * ll,
               "ratio_low": ll / bl, "bytes_ceiling": ceilings[s], "lora_profile_us": statistics.median(lora_us[s])}
        for lo, name in ((False, "base"), (True, "lora")):
            for j, ph in enumerate(("gemm1", "gemm2")):
                row[f"{name}_{ph}_us"] = statistics.median(v[j] for v in gemm_us[(s, lo)])
        rows.append(row)
        print(f"{s[0]:7s} threads {s[1]} T {s[2]}: base {row['base_us']:8.1f} us, LoRA {row['lora_us']:8.1f} us: ratio "
              f"{row['ratio']:.3f}; least disturbed {row['base_low_us']:8.1f} / {row['lora_low_us']:8.1f} us: ratio "
              f"{row['ratio_low']:.3f} (bytes {row['bytes_ceiling']:.3f}); profile 'lora' {row['lora_profile_us']:.1f} "
              f"us/task; gemm1 {row['base_gemm1_us']:.1f} -> {row['lora_gemm1_us']:.1f} us, gemm2 "
              f"{row['base_gemm2_us']:.1f} -> {row['lora_gemm2_us']:.1f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
