# ruff: noqa: B023  (each lambda is timed within its own loop turn)
"""Session 27 probe: the two absorbed-MLA bmms alone (DeepSeek-V3 sizes, H 128, Dn = Dv = 128, Lkv 512, bf16) at
batch 1-64, weights cycling through 8 sets (> L2), as the bench and the model lay them out. Bytes = both weights."""
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_mla_decode import graph_time  # noqa: E402

H, DN, DV, L, SETS = 128, 128, 128, 512, 8
dev, dt = "cuda", torch.bfloat16
kvb = torch.randn(SETS, H, DN + DV, L, dtype=dt, device=dev) * 0.05  # kv_b_proj as the model views it
w_uk = [kvb[i, :, :DN] for i in range(SETS)]  # [H, Dn, Lkv] views (strided heads)
w_uv = [kvb[i, :, DN:] for i in range(SETS)]
w_uk_c = [w.contiguous() for w in w_uk]
w_uv_t = [w.transpose(1, 2).contiguous() for w in w_uv]  # [H, Lkv, Dv]
wbytes = 2 * H * DN * L * 2
rows = []
for b in (1, 4, 16, 64):
    q = torch.randn(b, H, DN, dtype=dt, device=dev)
    o = torch.randn(b, H, L, dtype=dt, device=dev)
    res = {"batch": b}
    variants = {
        "model_views": lambda i: (torch.bmm(q.transpose(0, 1), w_uk[i % SETS]),
                                  torch.bmm(o.transpose(0, 1), w_uv[i % SETS].transpose(1, 2))),
        "contiguous": lambda i: (torch.bmm(q.transpose(0, 1), w_uk_c[i % SETS]),
                                 torch.bmm(o.transpose(0, 1), w_uv_t[i % SETS])),
        "q_only": lambda i: torch.bmm(q.transpose(0, 1), w_uk[i % SETS]),
        "o_only": lambda i: torch.bmm(o.transpose(0, 1), w_uv[i % SETS].transpose(1, 2)),
    }
    for name, fn in variants.items():
        med, best = graph_time(fn, 16, 7)
        nbytes = wbytes if name in ("model_views", "contiguous") else wbytes // 2
        res[name] = {"us": med * 1e6, "tbps": nbytes / med / 1e12}
    rows.append(res)
    print(json.dumps(res), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
