"""MLA extend/prefill attention in its two forms (layers/attention/mla.py) at DeepSeek-V3 sizes (H 128,
Lkv 512, R 64, Dn 128, Dv 128, bf16) on the GPU: the expanded form (kv_b_proj over the whole sequence,
then SDPA) against the absorbed form (every new token a decode query over its causal prefix through
the Triton decode kernel), for one sequence of `prefix` cached + `q` new tokens.

Per (prefix, q): the median time of each form (CUDA events, --reps calls after a warm-up), the form the
model's cost model (MLAAttention._extend_form with mla.ABSORBED_FLOP_COST) picks and whether that is
the faster one, and the measured cost of an absorbed FLOP in expanded FLOPs ((t_abs / F_abs) / (t_exp /
F_exp)), which is what ABSORBED_FLOP_COST models. Only the attention differs between the forms (the
projections before and after are the same), so only that is timed.

    python benchmarks/bench_mla_extend.py --out mla_extend.json
    python benchmarks/bench_mla_extend.py --device cpu --grid 0:8 4:2     # smoke run (tests), torch paths
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridmoe.layers.attention import mla
from hybridmoe.layers.attention.mla import MLAAttention, MLAConfig

GRID = ["0:64", "0:256", "0:1024", "0:4096", "1024:16", "1024:64", "1024:256", "4096:1", "4096:16", "4096:64",
        "4096:128", "4096:256", "4096:1024", "16384:16", "16384:64", "16384:256"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", nargs="+", default=GRID, help="PREFIX:Q cases")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--lkv", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def flops(layer: MLAAttention, q: int, n: int) -> tuple[float, float]:
    """(expanded, absorbed) FLOPs of one sequence, as _extend_form counts them."""
    h, lkv, dn, r, dv = layer.num_heads, layer.kv_lora_rank, layer.nope_dim, layer.rope_dim, layer.v_dim
    return (n * 2 * lkv * h * (dn + dv) + q * n * 2 * h * (dn + r + dv),
            q * n * 2 * h * (2 * lkv + r) + q * 2 * h * lkv * (dn + dv))


def timed(fn, reps: int, device: str) -> float:
    fn()  # warm-up (Triton compile, cuBLAS plans)
    times = []
    for _ in range(reps):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(a: argparse.Namespace, layer: MLAAttention, ctx, prefix: int, q: int, dev: torch.device,
            dtype: torch.dtype) -> dict:
    """Both forms on one sequence of `prefix` cached + `q` new tokens: checked against each other, timed."""
    n = prefix + q
    pages = -(-n // a.page)
    cache = torch.randn(pages + 1, a.page, a.lkv + a.rope, device=dev).to(dtype)  # page 0: scratch
    meta = SimpleNamespace(query_lens_cpu=[q], seq_lens_cpu=[n],
                           block_table=torch.arange(1, pages + 1, dtype=torch.int32, device=dev)[None])
    q_nope = torch.randn(q, a.heads, a.nope, device=dev).to(dtype)
    q_pe = torch.randn(q, a.heads, a.rope, device=dev).to(dtype)
    o_exp = layer._extend(q_nope, q_pe, cache, meta).float()
    o_abs = layer._extend_absorbed(q_nope, q_pe, cache, meta, ctx).float()
    rel = ((o_abs - o_exp).norm() / o_exp.norm()).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"the forms disagree at {prefix}:{q}: rel {rel:.2e}"
    t_exp = timed(lambda: layer._extend(q_nope, q_pe, cache, meta), a.reps, a.device)
    t_abs = timed(lambda: layer._extend_absorbed(q_nope, q_pe, cache, meta, ctx), a.reps, a.device)
    f_exp, f_abs = flops(layer, q, n)
    chosen = layer._extend_form(meta, cache, ctx)
    faster = "absorbed" if t_abs < t_exp else "expanded"
    cost = (t_abs / f_abs) / (t_exp / f_exp)
    print(f"prefix {prefix:>6} q {q:>5}: expanded {t_exp * 1e6:9.1f} us ({f_exp / t_exp / 1e12:6.1f} TFLOP/s), "
          f"absorbed {t_abs * 1e6:9.1f} us ({f_abs / t_abs / 1e12:6.1f} TFLOP/s); faster {faster:8s} "
          f"chosen {chosen:8s} {'ok' if chosen == faster else 'MISS'}; absorbed FLOP cost {cost:.2f}; rel {rel:.1e}",
          flush=True)
    return dict(prefix=prefix, q=q, expanded_s=t_exp, absorbed_s=t_abs, expanded_tflops=f_exp / t_exp / 1e12,
                absorbed_tflops=f_abs / t_abs / 1e12, chosen=chosen, faster=faster, absorbed_flop_cost=cost,
                rel_diff=rel)


def main(argv=None) -> dict:
    a = parse_args(argv)
    dev = torch.device(a.device)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        raise SystemExit(2)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    cfg = MLAConfig(q_lora_rank=None, kv_lora_rank=a.lkv, qk_nope_head_dim=a.nope, qk_rope_head_dim=a.rope,
                    v_head_dim=a.v_dim)
    layer = MLAAttention(0, 256, a.heads, cfg, rotary=None, softmax_scale=(a.nope + a.rope) ** -0.5)
    layer.kv_b_proj.to(dev, dtype).weight.data.normal_(0, a.lkv ** -0.5)
    ctx = SimpleNamespace(backend=SimpleNamespace(name="triton" if a.device == "cuda" else "torch"))
    rows = []
    print(f"MLA extend, H {a.heads} Lkv {a.lkv} R {a.rope} Dn {a.nope} Dv {a.v_dim}, {dtype}, page {a.page}; "
          f"ABSORBED_FLOP_COST {mla.ABSORBED_FLOP_COST}")
    for case in a.grid:
        prefix, q = (int(x) for x in case.split(":"))
        rows.append(measure(a, layer, ctx, prefix, q, dev, dtype))
    costs = [r["absorbed_flop_cost"] for r in rows]
    hits = sum(r["chosen"] == r["faster"] for r in rows)
    print(f"cost model picked the faster form in {hits} of {len(rows)} cases; measured absorbed FLOP cost median "
          f"{statistics.median(costs):.2f} (range {min(costs):.2f}-{max(costs):.2f})")
    result = dict(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, rows=rows,
                  absorbed_flop_cost_setting=mla.ABSORBED_FLOP_COST, picked_faster=hits)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
