"""The CPU-only path's native decode attention (csrc/attn_decode.cpp, attn_pool.cpp) alone: one decode
step of one layer over a paged bf16 KV cache, as the cache bytes read per second.

    python benchmarks/bench_cpu_attn.py --lens 64,1024,16384               # Qwen3-30B-A3B heads, every core
    python benchmarks/bench_cpu_attn.py --threads 1 --cold                 # KV evicted before each call
    python benchmarks/bench_cpu_attn.py --libs old=/tmp/a.so,new=/tmp/b.so --threads 1 --cold   # A/B, one process
    python benchmarks/bench_cpu_attn.py --kernels avx2,avx512 --cold    # the two span kernels, one process

--cold flushes the caches (writes a 64 MB buffer) before each timed call, as at decode where every
layer's cache was evicted by the other layers since the last step; the default repeats the call on a
warm cache. Pages of the sequence are in random order. With --libs the libraries (built with
hybridmoe.cpu.build.build_library) are called through ctypes directly, interleaved, on one thread
(hm_attn_decode), for a comparison within one process: the host's bandwidth drifts between processes.
Medians over --repeats rounds.
"""

from __future__ import annotations

import argparse
import ctypes as C
import functools
import json
import statistics
import time

import torch


def make_case(L: int, hq: int, hkv: int, d: int, page: int, seed: int = 0):
    """(AttnDecode struct, tensors it points at) for one sequence of L positions, the last one new."""
    from hybridmoe.cpu.attn_decode import AttnDecode

    g = torch.Generator().manual_seed(seed)
    npages = -(-L // page) + 1
    kc = torch.randn(npages, page, hkv, d, generator=g).bfloat16()
    vc = torch.randn(npages, page, hkv, d, generator=g).bfloat16()
    bt = torch.randperm(npages, generator=g)[: npages - 1].to(torch.int32).reshape(1, -1).contiguous()
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g).bfloat16()
    qn, kn = torch.ones(d).bfloat16(), torch.ones(d).bfloat16()
    cos, sin = torch.rand(L + 8, d // 2, generator=g), torch.rand(L + 8, d // 2, generator=g)
    pos = torch.tensor([L - 1])
    slots = torch.tensor([int(bt[0, (L - 1) // page]) * page + (L - 1) % page])
    lens = torch.tensor([L], dtype=torch.int32)
    out = torch.empty(1, hq * d).bfloat16()
    keep = (kc, vc, bt, qkv, qn, kn, cos, sin, pos, slots, lens, out)
    a = AttnDecode(qkv.data_ptr(), qn.data_ptr(), kn.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(),
                   kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), bt.data_ptr(), lens.data_ptr(), out.data_ptr(),
                   (hq + 2 * hkv) * d, bt.shape[1], hq * d, 1, hq, hkv, d, page, 0, 1e-6, d ** -0.5)
    return a, keep


def _flush(buf: torch.Tensor) -> None:
    """Evicts the caches by writing buf, on one torch thread: on many cores torch's OMP threads would
    spin after the write and compete with the pool's pinned threads in the timed call (1024 positions on
    the 16-core H200 host: 5.3 ms cold against 0.24 ms warm with torch's 16 threads)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        buf.add_(1)
    finally:
        torch.set_num_threads(n)


def _call_one(lb, s, err) -> int:
    """hm_attn_decode of library lb on this thread."""
    return lb.hm_attn_decode(C.byref(s), err, len(err))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="64,1024,4096,16384", help="sequence lengths (positions)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="pool threads (default: every physical core)")
    p.add_argument("--cold", action="store_true", help="flush the caches before each timed call")
    p.add_argument("--calls", type=int, default=20, help="calls a round (the best of them counts)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--libs", default=None, help="name=path,...: libraries to compare on one thread (hm_attn_decode)")
    p.add_argument("--kernels", default="auto",
                   help="span kernels to compare, interleaved (attn_decode.set_kernel): e.g. avx2,avx512; "
                        "those that cannot run here are skipped with a line saying so")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from hybridmoe.cpu import attn_decode
    from hybridmoe.cpu.attn_decode import AttnDecode, _lib
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.cpu.topology import physical_cores

    lens = [int(x) for x in a.lens.split(",")]
    if a.libs:
        callers = {}
        for item in a.libs.split(","):
            name, path = item.split("=", 1)
            lb = C.CDLL(path)
            lb.hm_attn_decode.restype = C.c_int
            lb.hm_attn_decode.argtypes = [C.POINTER(AttnDecode), C.c_char_p, C.c_int]
            callers[name] = functools.partial(_call_one, lb)
        threads = 1
    else:
        threads = a.threads or len(physical_cores())
        pool = CPUThreadPool(threads) if threads > 1 else None
        lb = _lib()
        handle = pool.handle if pool is not None else None
        callers = {}
        for kern in a.kernels.split(","):
            if kern not in attn_decode.KERNELS:
                p.error(f"--kernels: unknown kernel {kern!r}; choose from {list(attn_decode.KERNELS)}")
            if not attn_decode.kernel_available(kern):
                print(f"# kernel {kern} cannot run here: skipped", flush=True)
                continue

            def call(s, e, kern=kern):
                attn_decode.set_kernel(kern)
                return lb.hm_attn_decode_pool(handle, C.byref(s), e, len(e))

            callers["native" if a.kernels == "auto" else kern] = call
    err = C.create_string_buffer(256)
    cases = {L: make_case(L, a.heads, a.kv_heads, a.head_dim, a.page) for L in lens}
    flush = torch.zeros(64 << 20, dtype=torch.uint8) if a.cold else None
    times: dict[tuple[str, int], list[float]] = {(n, L): [] for n in callers for L in lens}
    for _ in range(a.repeats):
        for L in lens:
            s = cases[L][0]
            for name, call in callers.items():
                best = float("inf")
                for _ in range(a.calls):
                    if flush is not None:
                        _flush(flush)
                    t0 = time.perf_counter()
                    if call(s, err):
                        raise SystemExit(f"hm_attn_decode failed: {err.value.decode()}")
                    best = min(best, time.perf_counter() - t0)
                times[(name, L)].append(best)
    res = {"threads": threads, "cold": a.cold, "shape": {"heads": a.heads, "kv_heads": a.kv_heads,
                                                          "head_dim": a.head_dim, "page": a.page}, "runs": []}
    for L in lens:
        kv = 2 * L * a.kv_heads * a.head_dim * 2
        line = f"L={L:6d} ({kv / 1e6:6.2f} MB of KV)"
        for name in callers:
            t = statistics.median(times[(name, L)])
            res["runs"].append({"lib": name, "len": L, "us": t * 1e6, "gbps": kv / t / 1e9})
            line += f"  {name}: {t * 1e6:9.1f} us {kv / t / 1e9:6.2f} GB/s"
        print(line, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
