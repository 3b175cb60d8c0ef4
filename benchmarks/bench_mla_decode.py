"""MLA decode kernel speed at DeepSeek-V3 sizes (H 128, Lkv 512, R 64, bf16), batch x context, on the GPU.

Per row (B sequences of `context` tokens each, page size --page) two timings, each a CUDA graph of many
calls over distinct cache pages (and distinct weight sets), so that L2 does not serve what a real
decode step reads from HBM; median of --reps replays:
  - the kernel alone (hybridmoe/layers/attention/mla_triton.mla_decode): latent cache bytes / time;
  - the absorbed attention it sits in: q_lat = q_nope @ W_UK, the kernel, out = o_lat @ W_UV^T, per head
    (torch.bmm): (latent cache + W_UK + W_UV bytes) / time. This is the issue's acceptance metric
    ("bytes read (latent cache + absorbed weights) / time", at least 0.5 of the copy bandwidth at 8K+).
Both as a ratio of the device-to-device copy bandwidth measured in the same run (best of several,
counted as bytes read + written, like bench_decode.py). q and the outputs are left out of the bytes
(< 0.1%). TFLOP/s of the kernel come beside: at H 128 it does 2 H (2 Lkv + R) FLOP per (Lkv + R) * 2
cache bytes, ~242 FLOP/B, so a kernel ratio of 0.5 to a ~4.2 TB/s copy means ~510 TFLOP/s of tensor work.

    python benchmarks/bench_mla_decode.py --check --out mla.json     # the table, checked (~1-2 min on an H200)
    python benchmarks/bench_mla_decode.py --sweep --out sweep.json   # tiles and split counts on a few shapes
    python benchmarks/bench_mla_decode.py --dry-run                  # the plan only (no GPU needed)

`--device cpu` (with TRITON_INTERPRET=1 and tiny sizes) runs the whole script on the CPU, timings
meaningless: the test suite's smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Tiles the sweep times: (block_h, block_n, num_warps, num_stages[, transposed]). 64-head tiles compile to wgmma
# with 8 warps, smaller ones to mma.sync (offline sm_90 compiles; see mla_triton._CONFIGS). Transposed: the
# kernel's TRANS form (tokens and the latent width as the dots' M).
SWEEP_TILES = [(64, 16, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2),
               (64, 32, 8, 2, 1), (64, 64, 8, 2, 1), (64, 64, 8, 3, 1), (64, 128, 8, 1, 1), (32, 32, 8, 2, 1),
               (32, 64, 8, 2, 1), (32, 64, 4, 2, 1), (16, 64, 4, 2, 1)]
SWEEP_SHAPES = [(1, 8192), (4, 8192), (16, 8192), (64, 8192), (1, 32768), (64, 32768)]
CHECK_TOL = 2e-2  # bf16: see tests/test_mla_triton.py
ELT = 2  # bytes of a bf16 / fp16 element


@dataclass
class Row:
    """One (batch, context) of the table and how it is measured."""

    batch: int
    context: int
    cache_bytes: int  # latent cache rows of all sequences (what the kernel must read)
    weight_bytes: int  # W_UK + W_UV of one layer, H * (Dn + Dv) * Lkv elements
    pages_per_seq: int
    rotations: int  # distinct block tables (disjoint pages) the graph cycles through
    calls_per_graph: int
    pool_limit_bytes: int  # cache bytes the pool can give as distinct pages: rotations * cache_bytes at most


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", help="default 1 4 16 64 (--sweep: its shapes)")
    p.add_argument("--contexts", type=int, nargs="+", help="default 1K 4K 8K 16K 32K (--sweep: its shapes)")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--lkv", type=int, default=512, help="kv_lora_rank")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim (W_UK)")
    p.add_argument("--v-dim", type=int, default=128, help="v_head_dim (W_UV)")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--reps", type=int, default=7, help="timed graph replays per measurement (median)")
    p.add_argument("--min-calls", type=int, default=8, help="kernel calls per graph at least")
    p.add_argument("--l2-flush-mb", type=float, default=256.0,
                   help="distinct cache (and weight) bytes a graph cycles through at least: > L2 (50 MB on H200)")
    p.add_argument("--no-absorbed", action="store_true", help="time the kernel alone only")
    p.add_argument("--check", action="store_true", help="compare every row to mla_decode_ref before timing")
    p.add_argument("--sweep", action="store_true", help="time SWEEP_TILES and split counts on SWEEP_SHAPES")
    p.add_argument("--sweep-tiles", type=_tile_arg, nargs="+", metavar="H,N,W,S[,T]",
                   help="--sweep: time these tiles instead of SWEEP_TILES (e.g. 32,128,8,1,1)")
    p.add_argument("--tile", type=int, nargs="+", metavar="N",
                   help="force the kernel tile: BLOCK_H BLOCK_N WARPS STAGES [TRANSPOSED 0/1] "
                        "(default: mla_triton.decode_config)")
    p.add_argument("--splits", type=int, help="force the split count (default: mla_triton.choose_num_splits)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write it, no GPU")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run under TRITON_INTERPRET=1 (wall-clock timing, no graphs)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    return p.parse_args(argv)


def _tile_arg(text: str) -> tuple[int, ...]:
    """A sweep tile "BLOCK_H,BLOCK_N,WARPS,STAGES[,TRANSPOSED]"."""
    try:
        tile = tuple(int(v) for v in text.split(","))
    except ValueError:
        tile = ()
    if len(tile) not in (4, 5) or min(tile[:4]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 4 or 5 positive integers, H,N,W,S[,T]")
    return tile


def shapes_of(a: argparse.Namespace) -> list[tuple[int, int]]:
    if a.sweep and a.batches is None and a.contexts is None:
        return SWEEP_SHAPES
    return [(b, c) for b in a.batches or [1, 4, 16, 64] for c in a.contexts or [1024, 4096, 8192, 16384, 32768]]


def plan(a: argparse.Namespace, shapes: list[tuple[int, int]]) -> tuple[int, int, list[Row]]:
    """(pool pages incl. scratch page 0, weight sets, rows). The pool holds the largest row or the L2
    flush size, whichever is more; smaller rows cycle through disjoint page sets of it."""
    row_tok = (a.lkv + a.rope) * ELT
    flush = int(a.l2_flush_mb * 2**20)
    pages = [b * math.ceil(c / a.page) for b, c in shapes]
    pool_pages = max(max(pages), math.ceil(flush / (row_tok * a.page))) + 1
    weight_bytes = a.heads * (a.nope + a.v_dim) * a.lkv * ELT
    weight_sets = max(1, min(16, math.ceil(flush / weight_bytes)))
    rows = []
    for (b, c), n in zip(shapes, pages):
        cache = b * c * row_tok
        fit = (pool_pages - 1) // n  # disjoint page sets the pool holds
        rot = max(1, min(math.ceil(flush / cache), fit))
        rows.append(Row(b, c, cache, weight_bytes, math.ceil(c / a.page), rot, max(rot, a.min_calls), fit * cache))
    return pool_pages, weight_sets, rows


def graph_time(fn, calls: int, reps: int, device: str = "cuda") -> tuple[float, float]:
    """(median, best) seconds per call of fn(i), i < calls, all captured in one CUDA graph."""
    import torch

    if device != "cuda":  # smoke run: plain calls, wall clock
        fn(0)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            times.append((time.perf_counter() - t) / calls)
        return statistics.median(times), min(times)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 2)):
            fn(i)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / calls)
    del graph
    return statistics.median(times), min(times)


def copy_bandwidth(nbytes: int = 1 << 30, tries: int = 10, device: str = "cuda") -> float:
    """Device-to-device copy of an nbytes tensor, (bytes read + written) / time, best of `tries` replays."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    _, best = graph_time(lambda i: dst.copy_(src), 4, tries, device)
    return 2 * nbytes / best


class Bench:
    """The GPU buffers shared by all rows: the cache pool, the weight sets, q and output buffers."""

    def __init__(self, a: argparse.Namespace, pool_pages: int, weight_sets: int):
        import torch

        from hybridmoe.layers.attention import mla_triton

        self.a, self.m = a, mla_triton
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count if a.device == "cuda" else 4
        dev = a.device
        self.pool = torch.empty(pool_pages, a.page, a.lkv + a.rope, dtype=self.dtype, device=dev).normal_()
        self.w_uk = torch.randn(weight_sets, a.heads, a.nope, a.lkv, dtype=self.dtype, device=dev) * a.nope**-0.5
        self.w_uv = torch.randn(weight_sets, a.heads, a.v_dim, a.lkv, dtype=self.dtype, device=dev) * a.lkv**-0.5
        self.scale = (a.nope + a.rope) ** -0.5

    def setup(self, row: Row, seed: int = 0) -> dict:
        import torch

        a, dev = self.a, self.a.device
        g = torch.Generator(device=dev).manual_seed(seed)
        n = row.batch * row.pages_per_seq
        perm = torch.randperm(self.pool.shape[0] - 1, device=dev, generator=g)[: row.rotations * n] + 1
        b = row.batch
        return dict(
            tables=perm.view(row.rotations, b, row.pages_per_seq).to(torch.int32),
            lens=torch.full((b,), row.context, dtype=torch.int32, device=dev),
            q_nope=torch.randn(a.heads, b, a.nope, dtype=self.dtype, device=dev),  # [H, B, Dn] as bmm wants
            q_lat=torch.randn(a.heads, b, a.lkv, dtype=self.dtype, device=dev),
            q_rope=torch.randn(b, a.heads, a.rope, dtype=self.dtype, device=dev),
            o_lat=torch.empty(b, a.heads, a.lkv, dtype=self.dtype, device=dev),
            out=torch.empty(a.heads, b, a.v_dim, dtype=self.dtype, device=dev),
        )

    def kernel(self, x: dict, i: int, **kw) -> None:
        """One decode attention over rotation i's pages (q_lat as the absorbed bmm leaves it: [H, B, Lkv])."""
        tables = x["tables"]
        self.m.mla_decode(x["q_lat"].transpose(0, 1), x["q_rope"], self.pool, tables[i % tables.shape[0]],
                          x["lens"], self.scale, x["o_lat"], **kw)

    def absorbed(self, x: dict, i: int, **kw) -> None:
        """q_nope @ W_UK, the kernel, o_lat @ W_UV^T, with weight set i (distinct layers' weights)."""
        import torch

        w = i % self.w_uk.shape[0]
        torch.bmm(x["q_nope"], self.w_uk[w], out=x["q_lat"])  # [H, B, Dn] @ [H, Dn, Lkv]
        self.kernel(x, i, **kw)
        torch.bmm(x["o_lat"].transpose(0, 1), self.w_uv[w].transpose(1, 2), out=x["out"])  # -> [H, B, Dv]

    def check(self, x: dict) -> float:
        import torch

        self.kernel(x, 0, **self.kw())
        ref = self.m.mla_decode_ref(x["q_lat"].transpose(0, 1), x["q_rope"], self.pool, x["tables"][0], x["lens"],
                                    self.scale)
        err = ((x["o_lat"].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        del ref
        if self.a.device == "cuda":
            torch.cuda.empty_cache()
        return err

    def config(self, tile: tuple):
        """MLADecodeConfig of a tile tuple (4 ints, or 5 with the transposed flag)."""
        if len(tile) not in (4, 5):
            raise SystemExit(f"--tile: 4 or 5 numbers, got {list(tile)}")
        return self.m.MLADecodeConfig(*tile[:4], transposed=bool(tile[4]) if len(tile) == 5 else False)

    def kw(self, tile: tuple | None = None, splits: int | None = None) -> dict:
        tile = tile or self.a.tile
        kw = {}
        if tile:
            kw["config"] = self.config(tile)
        if splits or self.a.splits:
            kw["num_splits"] = splits or self.a.splits
        return kw

    def auto_splits(self, row: Row, tile: tuple | None = None) -> int:
        """The split count mla_decode picks for this row and tile (default: --tile / --splits, else its own)."""
        a = self.a
        if tile is None and a.splits:
            return a.splits
        tile = tile or a.tile
        cfg = self.config(tile) if tile else self.m.decode_config(self.dtype, a.lkv, a.heads,
                                                                             a.device != "cuda")
        return self.m.choose_num_splits(row.batch, a.heads, a.lkv, a.rope, row.pages_per_seq * a.page, cfg, self.sms,
                                        partial_bytes=ELT)


def kernel_flops(a: argparse.Namespace, row: Row) -> int:
    return 2 * row.batch * row.context * a.heads * (2 * a.lkv + a.rope)


def run_table(a: argparse.Namespace, bench: Bench, rows: list[Row], copy_bw: float) -> list[dict]:
    out = []
    print(f"{'B':>3} {'ctx':>6} {'X':>3} {'cache MB':>9} {'kern us':>8} {'TB/s':>6} {'ratio':>6} {'TFLOP/s':>7} "
          f"{'absorb us':>9} {'TB/s':>6} {'ratio':>6}{'  check' if a.check else ''}", flush=True)
    for row in rows:
        x = bench.setup(row)
        res = dict(asdict(row), splits=bench.auto_splits(row))
        line_check = ""
        if a.check:
            err = bench.check(x)
            res["check_rel_err"] = err
            line_check = f"  {err:.1e}" + ("" if err <= CHECK_TOL else " FAIL")
        kw = bench.kw()
        med, best = graph_time(lambda i: bench.kernel(x, i, **kw), row.calls_per_graph, a.reps, a.device)  # noqa: B023
        res.update(kernel_s=med, kernel_best_s=best, kernel_gbps=row.cache_bytes / med / 1e9,
                   kernel_ratio=row.cache_bytes / med / copy_bw, kernel_tflops=kernel_flops(a, row) / med / 1e12)
        line = (f"{row.batch:>3} {row.context:>6} {res['splits']:>3} {row.cache_bytes / 1e6:>9.1f} {med * 1e6:>8.1f} "
                f"{res['kernel_gbps'] / 1e3:>6.2f} {res['kernel_ratio']:>6.3f} {res['kernel_tflops']:>7.1f} ")
        if not a.no_absorbed:
            med, best = graph_time(lambda i: bench.absorbed(x, i, **kw), row.calls_per_graph, a.reps, a.device)  # noqa: B023
            total = row.cache_bytes + row.weight_bytes
            res.update(absorbed_s=med, absorbed_best_s=best, absorbed_gbps=total / med / 1e9,
                       absorbed_ratio=total / med / copy_bw)
            line += f"{med * 1e6:>9.1f} {res['absorbed_gbps'] / 1e3:>6.2f} {res['absorbed_ratio']:>6.3f}"
        print(line + line_check, flush=True)
        out.append(res)
    return out


def run_sweep(a: argparse.Namespace, bench: Bench, rows: list[Row], copy_bw: float) -> list[dict]:
    """Every tile at its automatic split count, and the default tile at half and twice that, per shape."""
    from triton.runtime.errors import OutOfResources

    out = []
    default = bench.m.decode_config(bench.dtype, a.lkv, a.heads, False)
    default = (default.block_h, default.block_n, default.num_warps, default.num_stages) + (
        (1,) if default.transposed else ())
    print(f"{'B':>3} {'ctx':>6} {'tile':>18} {'X':>3} {'kern us':>8} {'ratio':>6} {'TFLOP/s':>7}", flush=True)
    for row in rows:
        x = bench.setup(row)
        trials = [(t, bench.auto_splits(row, t), True) for t in a.sweep_tiles or SWEEP_TILES]
        xd = bench.auto_splits(row, default)
        trials += [(default, s, False) for s in sorted({max(1, xd // 2), xd * 2}) if s != xd]
        for tile, splits, auto in trials:
            res = dict(batch=row.batch, context=row.context, tile=list(tile), splits=splits, auto_splits=auto)
            kw = bench.kw(tile, splits)
            try:
                med, _ = graph_time(lambda i: bench.kernel(x, i, **kw), row.calls_per_graph, a.reps,  # noqa: B023
                                    a.device)
            except OutOfResources as e:
                res["error"] = str(e)[:200]
                print(f"{row.batch:>3} {row.context:>6} {tile!s:>18} {splits:>3}  does not fit: {e}", flush=True)
                out.append(res)
                continue
            res.update(kernel_s=med, kernel_ratio=row.cache_bytes / med / copy_bw,
                       kernel_tflops=kernel_flops(a, row) / med / 1e12)
            print(f"{row.batch:>3} {row.context:>6} {tile!s:>18} {splits:>3} {med * 1e6:>8.1f} "
                  f"{res['kernel_ratio']:>6.3f} {res['kernel_tflops']:>7.1f}", flush=True)
            out.append(res)
    by_tile: dict[tuple, list[float]] = {}
    for r in out:
        if "kernel_s" in r and r["auto_splits"]:
            by_tile.setdefault(tuple(r["tile"]), []).append(r["kernel_ratio"])
    full = {t: math.exp(statistics.fmean(map(math.log, v))) for t, v in by_tile.items() if len(v) == len(rows)}
    if full:
        best = max(full, key=full.get)
        print(f"best tile over the shapes (geometric mean ratio {full[best]:.3f}): {best}; default {default} "
              f"{full.get(default, float('nan')):.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    pool_pages, weight_sets, rows = plan(a, shapes_of(a))
    result = dict(args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                  l2_flush_bytes=int(a.l2_flush_mb * 2**20), pool_pages=pool_pages, weight_sets=weight_sets)
    if a.dry_run:
        print(f"pool: {pool_pages} pages of {a.page} ({pool_pages * a.page * (a.lkv + a.rope) * 2 / 2**30:.2f} GiB); "
              f"{weight_sets} weight sets of {rows[0].weight_bytes / 2**20:.1f} MiB")
        for r in rows:
            print(f"B {r.batch:>3} ctx {r.context:>6}: cache {r.cache_bytes / 2**20:8.1f} MiB, "
                  f"{r.rotations} page sets, {r.calls_per_graph} calls a graph")
        result["rows"] = [asdict(r) for r in rows]
    else:
        import torch

        if a.device == "cuda" and not torch.cuda.is_available():
            print("needs a CUDA GPU (or --dry-run, or --device cpu)", file=sys.stderr)
            return 2
        t0 = time.time()
        copy_bw = copy_bandwidth(device=a.device) if a.device == "cuda" else copy_bandwidth(1 << 24, 2, "cpu")
        bench = Bench(a, pool_pages, weight_sets)
        name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (smoke run)"
        print(f"{name}: copy {copy_bw / 1e12:.3f} TB/s (read + write, best); "
              f"H {a.heads} Lkv {a.lkv} R {a.rope} page {a.page} {a.dtype}; absorbed weights "
              f"{rows[0].weight_bytes / 2**20:.1f} MiB a layer", flush=True)
        result.update(device=name, copy_bw=copy_bw)
        key = "sweep" if a.sweep else "rows"
        result[key] = (run_sweep if a.sweep else run_table)(a, bench, rows, copy_bw)
        result["wall_s"] = time.time() - t0
        print(f"done in {result['wall_s']:.0f} s", flush=True)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    failed = [r for r in result.get("rows", []) if r.get("check_rel_err", 0.0) > CHECK_TOL]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
