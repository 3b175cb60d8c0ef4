"""Tests of the MLA decode kernel and its torch reference (hybridmoe/layers/attention/mla_triton.py).

Legend: B sequences, H heads, Lkv latent width, R rope width, N pages, S page size, P pages per
sequence in the block table, L a sequence's length, X context splits.

- mla_decode_ref is checked against an independent naive formulation: per sequence, only its L rows
  gathered, the latent expanded to a key [c_kv | k_pe] and a value c_kv for every head, plain fp64
  softmax attention of the query [q_lat | q_rope].
- The Triton kernel runs under the Triton interpreter on CPU. TRITON_INTERPRET must be set before
  triton is imported and other tests may import it first, so those tests run this file as a script
  in a subprocess (`python tests/test_mla_triton.py GROUP`).
- The `gpu` tests run the same cases compiled, DeepSeek-V3 sizes (H 128, Lkv 512, R 64) in bf16 at
  contexts 1 to 32768 and page sizes 1/16/64, several tiles, and a CUDA-graph capture and replay.

Tolerances, max |out - ref| / max |ref| with the reference in fp32/fp64 from the same (rounded) inputs:
fp32 1e-4 (IEEE fp32 dots); fp16 5e-3; bf16 2e-2 (the project's bf16 bound). Why bf16 needs it: the
scores are exact products accumulated in fp32 like the reference, so the error is the softmax weights
rounded to bf16 before the tl.dot with the latent (2^-9 relative each: with one dominant token, up to
2^-9 of the largest latent value, which can exceed max |ref|) plus the output's own bf16 rounding
(<= 2^-9 = 2e-3 of max |ref|). Measured under the interpreter: 4e-3 to 6.6e-3 (Lkv 24-64, <= 50 tokens),
4.4e-3 to 5.5e-3 (Lkv 512, 1000-4000 tokens); 1e-2 would leave too little margin for the short cases.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from interpreter import REPO, assert_interpreted, report, run_seeded_cases, script_main

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# A case: (name, seq_lens, H, Lkv, R, S, forced splits or None).
CASES = [
    ("b1_len1", [1], 1, 16, 8, 16, None),
    ("h3_lkv24_page4_ragged", [1, 4, 5, 9, 13], 3, 24, 8, 4, None),
    ("page1_splits3", [7, 1, 3], 4, 32, 8, 1, 3),
    ("page16_boundary_splits2", [16, 17, 33], 16, 64, 8, 16, 2),
    ("h20_two_head_blocks_lkv48", [40, 2], 20, 48, 8, 16, 4),
    ("splits_past_the_tokens", [3, 50], 5, 24, 8, 4, 7),
    ("page64_auto_splits", [70, 1, 64, 65], 6, 40, 16, 64, None),
    ("splits11_two_merge_chunks", [90, 5], 4, 32, 8, 4, 11),  # more splits than the merge loads at a time
]
GROUPS = {
    "fp32": (CASES, "fp32"),
    "half": (CASES[1:5], "fp16,bf16"),
    "edge": ([], ""),  # run_empty_sequence
}


def make_case(
    lens: list[int],
    heads: int,
    lkv: int,
    rope: int,
    page: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_pages: int = 3,
    extra_cols: int = 1,
) -> dict:
    """Random queries and a paged latent cache with every sequence's pages shuffled through the pool.

    Page 0 (scratch) and `spare_pages` unused pages hold garbage the kernel must not read; every
    block table has `extra_cols` unused entries past its last page, left at 0 (page 0), as the engine does.
    Returns mla_decode's arguments as a dict.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    num_pages = 1 + sum(pages) + spare_pages
    perm = 1 + torch.randperm(num_pages - 1, generator=g)  # page 0 is never a sequence's
    table = torch.zeros(len(lens), max(pages, default=0) + extra_cols, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    kv = torch.randn(num_pages, page, lkv + rope, generator=g)
    # Non-finite leftovers in the scratch page, the spare pages and every slot past a sequence's end (a
    # request that overflowed leaves them in pages it freed): reading them, even at probability 0, shows.
    kv[0] = float("nan")
    kv[perm[used:]] = float("inf")
    for b, n in enumerate(lens):
        last = table[b, pages[b] - 1] if pages[b] else None
        if last is not None and n % page:
            kv[last, n % page:] = float("-inf") if b % 2 else float("nan")
    q_lat = torch.randn(len(lens), heads, lkv, generator=g)
    q_rope = torch.randn(len(lens), heads, rope, generator=g)
    return dict(
        q_lat=q_lat.to(dtype).to(device),
        q_rope=q_rope.to(dtype).to(device),
        kv_cache=kv.to(dtype).to(device),
        block_table=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        scale=(lkv // 4 + rope) ** -0.5,
    )


def naive_mla(q_lat, q_rope, kv_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """Independent fp64 formulation on CPU: per sequence and head, softmax attention over its L rows. [B, H, Lkv]."""
    bsz, heads, lkv = q_lat.shape
    page = kv_cache.shape[1]
    out = torch.zeros(bsz, heads, lkv, dtype=torch.float64)
    cache = kv_cache.cpu().double()
    for b in range(bsz):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        rows = cache[block_table[b].cpu().long()[pos // page], pos % page]  # [L, Lkv+R]
        keys = rows[None].expand(heads, n, lkv + q_rope.shape[2])  # [H, L, Lkv+R] the same key for every head
        vals = rows[None, :, :lkv].expand(heads, n, lkv)  # [H, L, Lkv]
        q = torch.cat([q_lat[b], q_rope[b]], dim=-1).cpu().double()  # [H, Lkv+R]
        probs = torch.softmax(torch.einsum("hd,hld->hl", q, keys) * scale, dim=-1)
        out[b] = torch.einsum("hl,hld->hd", probs, vals)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    assert err == err, "NaN in the output"
    return err


def run_case(case: tuple, dtype: torch.dtype, device: str, seed: int = 0) -> float:
    """The kernel on one case, in three call forms (plain; `out=` with q_lat a transposed view; the same grid
    with other lengths). Returns the largest relative error against the naive formulation."""
    from hybridmoe.layers.attention.mla_triton import decode_config, mla_decode

    name, lens, heads, lkv, rope, page, splits = case
    x = make_case(lens, heads, lkv, rope, page, dtype, device, seed)
    out = mla_decode(**x, num_splits=splits)
    assert out.shape == (len(lens), heads, lkv) and out.dtype == dtype, name
    errs = [rel_err(out, naive_mla(**x))]
    # the transposed form of the kernel (TRANS), same tile
    cfg = replace(decode_config(dtype, lkv, heads, device != "cuda"), transposed=True)
    errs.append(rel_err(mla_decode(**x, num_splits=splits, config=cfg), naive_mla(**x)))
    # q_lat as the model makes it (bmm over heads, then transposed: strided), written into a given `out`.
    q_hb = x["q_lat"].transpose(0, 1).contiguous()  # [H, B, Lkv]
    given = torch.full_like(out, float("nan"))
    res = mla_decode(q_hb.transpose(0, 1), x["q_rope"], x["kv_cache"], x["block_table"], x["seq_lens"], x["scale"],
                     given, num_splits=splits)
    assert res is given and torch.equal(given, out), f"{name}: out= / strided q_lat differ"
    # Shorter lengths through the same shapes (what a graph replay does): 1 and a page boundary.
    shorter = torch.tensor([1 if b % 2 else min(n, page) for b, n in enumerate(lens)], dtype=torch.int32)
    x["seq_lens"] = shorter.to(device)
    errs.append(rel_err(mla_decode(**x, num_splits=splits), naive_mla(**x)))
    return max(errs)


def run_empty_sequence(device: str) -> list[str]:
    """A sequence of length 0 (beyond the contract's >= 1: a padded slot) gives zeros, split or not, and leaves
    its neighbours right."""
    from hybridmoe.layers.attention.mla_triton import mla_decode

    failures = []
    for splits in (1, 3):
        x = make_case([0, 21, 0], 5, 24, 8, 4, torch.float32, device)
        out = mla_decode(**x, num_splits=splits)
        ok = torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
        x1 = {k: (v[1:2] if torch.is_tensor(v) and k != "kv_cache" else v) for k, v in x.items()}
        err = rel_err(out[1:2], naive_mla(**x1))
        report(ok and err <= TOL[torch.float32], f"empty sequence splits={splits}: neighbour rel err {err:.2e}",
               failures)
    return failures


def run_group(group: str, device: str) -> list[str]:
    """Every case of a group in its dtypes, two seeds (the fp16/bf16 group under the interpreter: one, as the fp32
    group runs the same cases with both); returns the failure messages (empty when all pass)."""
    if group == "edge":
        return run_empty_sequence(device)
    cases, dtypes = GROUPS[group]
    seeds = (0,) if group == "half" and device == "cpu" else (0, 1)
    return run_seeded_cases(group, cases, dtypes.split(","), DTYPES, TOL, run_case, device, seeds)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("seed", [0, 1])
def test_ref_matches_naive(case: tuple, seed: int) -> None:
    """mla_decode_ref (whole block table gathered, masked) equals per-sequence, per-head attention."""
    pytest.importorskip("triton")
    from hybridmoe.layers.attention.mla_triton import mla_decode_ref

    _, lens, heads, lkv, rope, page, _ = case
    x = make_case(lens, heads, lkv, rope, page, torch.float32, "cpu", seed)
    out = mla_decode_ref(**x)
    assert out.shape == (len(lens), heads, lkv) and out.dtype == torch.float32
    assert rel_err(out, naive_mla(**x)) <= 1e-5  # fp32 vs fp64 sums of <= 100 terms


def test_ref_edge_cases() -> None:
    """B = 0; `out=`; a bf16 result rounded from the fp32 math; seq_len 0 (a padded slot) gives zeros."""
    pytest.importorskip("triton")
    from hybridmoe.layers.attention.mla_triton import mla_decode, mla_decode_ref

    x = make_case([], 4, 24, 8, 4, torch.float32, "cpu")
    assert mla_decode_ref(**x).shape == (0, 4, 24) and mla_decode(**x).shape == (0, 4, 24)
    x = make_case([5, 9], 3, 24, 8, 4, torch.float32, "cpu")
    given = torch.empty(2, 3, 24)
    assert mla_decode_ref(**x, out=given) is given and torch.equal(given, mla_decode_ref(**x))
    xb = {k: (v.bfloat16() if v.is_floating_point() else v) if torch.is_tensor(v) else v for k, v in x.items()}
    want = mla_decode_ref(**{k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                             for k, v in xb.items()})
    got = mla_decode_ref(**xb)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    x["seq_lens"] = torch.tensor([0, 9], dtype=torch.int32)
    out = mla_decode_ref(**x)
    assert torch.equal(out[0], torch.zeros(3, 24)) and torch.isfinite(out).all()


def test_choose_num_splits() -> None:
    """Splits from static sizes: one wave of programs on the SMs; none when the batch fills them."""
    pytest.importorskip("triton")
    from hybridmoe.layers.attention.mla_triton import choose_num_splits, decode_config

    cfg = decode_config(torch.bfloat16, 512, 128, False)
    assert (cfg.block_h, cfg.num_warps) == (64, 8)

    def splits(b: int, ctx: int, **kw) -> int:
        return choose_num_splits(b, 128, 512, 64, ctx, cfg, 132, **kw)

    assert splits(64, 8192) == 1  # 64 sequences x 2 head blocks = 128 programs: the SMs are full
    for b in (1, 4, 16):
        x = splits(b, 32768)
        assert 100 <= b * 2 * x <= 132, (b, x)  # one wave that uses most SMs
    assert splits(1, 1024) < splits(1, 8192)  # short contexts: the partials weigh more than the rows
    assert splits(1, 16) == 1  # one step of tokens: nothing to split
    assert splits(1, 10**6, max_splits=8) == 8
    assert decode_config(torch.bfloat16, 512, 3, False).block_h == 16  # tl.dot needs M >= 16
    assert decode_config(torch.float32, 24, 3, True).block_h == 16


# ---- the kernels compile for sm_90 (H100/H200) without a GPU --------------------------------------

# (dtype, H, Lkv, R, S): DeepSeek-V3 in bf16 at two page sizes, odd sizes in fp16 and fp32.
COMPILE_SHAPES = [("bf16", 128, 512, 64, 16), ("bf16", 128, 512, 64, 1), ("fp16", 20, 48, 8, 16),
                  ("fp32", 3, 24, 8, 4)]


@needs_triton
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("shape", COMPILE_SHAPES, ids=str)
def test_mla_kernels_compile_sm90(shape: tuple, split: bool, trans: bool) -> None:
    """What only the compiler rejects shows up here, not first on the GPU machine (like test_triton_compile.py)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybridmoe.layers.attention import mla_triton as M

    dt, heads, lkv, rope, page = shape
    torch_dt = DTYPES[dt]
    cfg = M.decode_config(torch_dt, lkv, heads, False)
    ptrs = dict(q_lat_ptr=f"*{dt}", q_rope_ptr=f"*{dt}", kv_ptr=f"*{dt}", block_table_ptr="*i32", seq_lens_ptr="*i32",
                out_ptr=f"*{dt}", part_out_ptr="*fp32", part_lse_ptr="*fp32", scale_log2e="fp32")
    consts = dict(NUM_HEADS=heads, LKV=lkv, ROPE=rope, PAGE_SIZE=page, SPLIT=split, BLOCK_H=cfg.block_h,
                  BLOCK_N=cfg.block_n, BLOCK_L=M._pad(lkv), BLOCK_R=M._pad(rope), DOT_FP32=torch_dt == torch.float32,
                  TRANS=trans)
    kernels = [(M._mla_decode_kernel, ptrs, consts, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))]
    if split:
        kernels.append((M._mla_reduce_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=f"*{dt}"),
                        dict(NUM_HEADS=heads, LKV=lkv, BLOCK_L=M._pad(lkv), BLOCK_X=M._REDUCE_BLOCK_X),
                        dict(num_warps=4)))
    for kernel, types, constexprs, options in kernels:
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


# ---- the kernel under the interpreter ---------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_mla_decode_interpreter(group: str) -> None:
    """Every case (fp32; fp16 and bf16 for some) under the Triton interpreter, in a subprocess."""
    assert_interpreted(__file__, group)


# ---- the benchmark script -----------------------------------------------------------------------


def _bench(*args: str, interpret: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_mla_decode.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_mla_decode_dry_run(tmp_path: Path) -> None:
    """benchmarks/bench_mla_decode.py parses its flags and plans the default table without a GPU (--dry-run)."""
    import json

    proc = _bench("--help")
    assert proc.returncode == 0 and "--dry-run" in proc.stdout, proc.stderr[-2000:]
    out = tmp_path / "mla.json"
    proc = _bench("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [
        (b, c) for b in (1, 4, 16, 64) for c in (1024, 4096, 8192, 16384, 32768)]
    r = rows[0]
    assert r["cache_bytes"] == 1024 * 576 * 2 and r["weight_bytes"] == 128 * (128 + 128) * 512 * 2
    # every graph cycles through more distinct cache bytes than L2 holds (or all the pool has)
    assert all(r["calls_per_graph"] * r["cache_bytes"] >= min(res["l2_flush_bytes"], r["pool_limit_bytes"])
               for r in rows)
    assert res["pool_pages"] * 16 >= 64 * 32768  # the largest row fits


@needs_triton
def test_bench_mla_decode_cpu_smoke(tmp_path: Path) -> None:
    """The whole script (table with --check and forced splits, then --sweep) on the CPU under the
    interpreter at tiny sizes: the code the H200 runs is not first exercised there. Checks the script,
    not the numbers."""
    import json

    tiny = ["--device", "cpu", "--heads", "20", "--lkv", "32", "--rope", "16", "--nope", "16", "--v-dim", "8",
            "--page", "4", "--reps", "1", "--min-calls", "2", "--l2-flush-mb", "0.02"]
    out = tmp_path / "table.json"
    proc = _bench(*tiny, "--batches", "1", "3", "--contexts", "37", "--check", "--splits", "3", "--out", str(out),
                  interpret=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["splits"]) for r in rows] == [(1, 3), (3, 3)]
    for r in rows:
        assert r["check_rel_err"] <= 2e-2 and r["kernel_s"] > 0 and r["absorbed_s"] > 0
        assert r["calls_per_graph"] >= 2 and r["rotations"] >= 1
    out = tmp_path / "sweep.json"
    proc = _bench(*tiny, "--sweep", "--batches", "2", "--contexts", "20", "--min-calls", "1", "--out", str(out),
                  interpret=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = json.loads(out.read_text())["sweep"]
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_mla_decode import SWEEP_TILES

    assert sum(r["auto_splits"] for r in sweep) == len(SWEEP_TILES) and all(r["kernel_s"] > 0 for r in sweep)
    assert "best tile" in proc.stdout
    # --sweep-tiles: only the tiles given (and the default tile's half / double splits)
    proc = _bench(*tiny, "--sweep", "--sweep-tiles", "16,16,4,1", "16,16,4,1,1", "--batches", "2", "--contexts", "20",
                  "--min-calls", "1", "--out", str(out), interpret=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["tile"] for r in sweep if r["auto_splits"]] == [[16, 16, 4, 1], [16, 16, 4, 1, 1]]
    proc = _bench("--dry-run", "--sweep", "--sweep-tiles", "64,64,8")
    assert proc.returncode == 2 and "expected 4 or 5 positive integers" in proc.stderr, proc.stderr[-2000:]


if __name__ == "__main__":  # interpreter entry point: python tests/test_mla_triton.py GROUP [GROUP ...]
    script_main(GROUPS, run_group)
