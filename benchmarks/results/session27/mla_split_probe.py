"""Session 27 probe: the MLA decode kernel (mla_triton.mla_decode, default tile) at small batches, where the
splits' partial outputs are as many bytes as the cache: split count x merge loads (BLOCK_X 1 = one split row a
step, as before; 8) x partial dtype (fp32; bf16), interleaved rounds, medians. Kernel time (splits + merge)."""
import json
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_mla_decode as B  # noqa: E402

from hybridmoe.layers.attention import mla_triton as M  # noqa: E402

shapes = [(1, 8192), (1, 32768), (4, 8192), (16, 8192)]
a = B.parse_args(["--batches", "1", "--contexts", "8192"])
pool_pages, weight_sets, rows = B.plan(a, shapes)
copy_bw = B.copy_bandwidth()
bench = B.Bench(a, pool_pages, weight_sets)
out = {"device": torch.cuda.get_device_name(), "copy_bw": copy_bw, "rows": []}
for row in rows:
    x = bench.setup(row)
    auto = bench.auto_splits(row)
    splits = sorted({auto, 16, 32, 48, 64, 96, 128} if row.batch == 1 else {auto, max(1, auto // 2), auto * 2})
    variants = [(s, bx, dt) for s in splits for bx in (1, 8) for dt in ("fp32", "bf16")]
    times: dict = {v: [] for v in variants}
    for _ in range(3):
        for s, bx, dt in variants:
            M._REDUCE_BLOCK_X, M._PARTIAL_DTYPE = bx, {"fp32": torch.float32, "bf16": torch.bfloat16}[dt]
            med, _ = B.graph_time(lambda i: bench.kernel(x, i, num_splits=s), row.calls_per_graph, 5)  # noqa: B023
            times[(s, bx, dt)].append(med)
    M._REDUCE_BLOCK_X, M._PARTIAL_DTYPE = 8, torch.float32
    for (s, bx, dt), ts in times.items():
        med = statistics.median(ts)
        r = dict(batch=row.batch, context=row.context, splits=s, auto=s == auto, block_x=bx, partial=dt,
                 us=med * 1e6, ratio=row.cache_bytes / med / copy_bw)
        out["rows"].append(r)
        print(f"B {row.batch:>2} ctx {row.context:>5} X {s:>3}{'*' if s == auto else ' '} bx {bx} {dt}: "
              f"{med * 1e6:7.1f} us  ratio {r['ratio']:.3f}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
