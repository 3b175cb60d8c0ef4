"""Tests of the `triton` attention backend against a dense pure-torch reference.

Legend: T new tokens, B sequences, Hq query heads, Hkv KV heads, D head dim, N pages, S page size,
P pages per sequence in the block table, L a sequence's length (cached prefix + new tokens).

The CPU tests run the kernels under the Triton interpreter. TRITON_INTERPRET must be set before
triton is imported, and other tests in the same pytest process may import triton first, so each
CPU test runs this file as a script in a subprocess with the variable set (`python
tests/test_triton_attention.py GROUP`). The `gpu` tests run the same cases on CUDA in-process.

Tolerances (max |out - ref| / max |ref|, reference in fp64): fp32 1e-4 (interpreter and GPU;
the kernels use IEEE fp32 dots for fp32 inputs), fp16 5e-3, bf16 2e-2.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interpreter import assert_interpreted, run_seeded_cases, script_main

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# A case: (name, sequences as (cached prefix, new tokens), Hq, Hkv, D, S, decode splits or None, extra bound).
# Decode cases have one new token per sequence; `extra` raises meta.max_seq_len above the longest
# sequence (a CUDA-graph bound), leaving some decode splits empty.
DECODE_CASES = [
    ("seq_len_1", [(0, 1)], 2, 2, 32, 16, None, 0),
    ("gqa4_mixed_splits3", [(0, 1), (16, 1), (15, 1), (39, 1)], 8, 2, 64, 16, 3, 0),
    ("page1_d48_gqa4", [(4, 1), (32, 1), (1, 1)], 4, 1, 48, 1, None, 0),
    ("page5_d80_empty_splits", [(6, 1), (25, 1)], 3, 3, 80, 5, 4, 37),
    ("d128_gqa2_splits2", [(63, 1), (8, 1)], 2, 1, 128, 16, 2, 0),
]
PREFILL_CASES = [
    ("t1_seq_len_1", [(0, 1)], 2, 2, 32, 16, None, 0),
    ("single_37", [(0, 37)], 2, 2, 64, 16, None, 0),
    ("mixed_gqa2_d48", [(16, 5), (0, 20), (7, 1)], 4, 2, 48, 16, None, 0),
    ("page1_d80_gqa3", [(3, 18), (0, 2)], 6, 2, 80, 1, None, 0),
    ("page3_d128_mha1", [(9, 9), (31, 17)], 1, 1, 128, 3, None, 0),
    ("prefix_two_pages", [(32, 16)], 2, 1, 32, 16, None, 0),
]
GROUPS = {
    "decode_fp32": (DECODE_CASES, True, "fp32"),
    "prefill_fp32": (PREFILL_CASES, False, "fp32"),
    "half": ([*DECODE_CASES[1:2], *PREFILL_CASES[2:3]], None, "fp16,bf16"),
}


def make_inputs(
    seqs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    page: int,
    dtype: torch.dtype,
    device: str,
    extra_bound: int = 0,
    seed: int = 0,
) -> dict:
    """Random q/k/v, a paged cache holding the prefixes, random non-contiguous block tables, metadata.

    Returns a dict with the backend's arguments plus `k_full`/`v_full`: per sequence [L, Hkv, D], the
    ground truth of what the cache must hold after the store.
    """
    from hybridmoe.layers.attention.base import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in seqs]
    pages_per_seq = [-(-n // page) for n in lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages hold garbage the kernels must not read
    perm = torch.randperm(num_pages, generator=g)
    p_max = max(pages_per_seq) + 1
    block_table = torch.zeros(len(seqs), p_max, dtype=torch.int32)
    # [N, S, Hkv, D] garbage everywhere a sequence has not written: NaN keys and infinite values, as a
    # request that overflowed leaves in pages it freed (a probability of 0 times them is still NaN)
    k_cache = torch.full((num_pages, page, hkv, d), float("nan"))
    v_cache = torch.full((num_pages, page, hkv, d), float("inf"))
    qs, ks, vs, slots, k_full, v_full = [], [], [], [], [], []
    used = 0
    for b, (ctx, new) in enumerate(seqs):
        ids = perm[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        block_table[b, : len(ids)] = ids.to(torch.int32)
        kf = torch.randn(ctx + new, hkv, d, generator=g)  # [L, Hkv, D]
        vf = torch.randn(ctx + new, hkv, d, generator=g)
        pos = torch.arange(ctx + new)
        slot = ids[pos // page].long() * page + pos % page  # [L]
        k_cache.view(-1, hkv, d)[slot[:ctx]] = kf[:ctx]
        v_cache.view(-1, hkv, d)[slot[:ctx]] = vf[:ctx]
        qs.append(torch.randn(new, hq, d, generator=g))
        ks.append(kf[ctx:])
        vs.append(vf[ctx:])
        slots.append(slot[ctx:])
        k_full.append(kf.to(dtype).to(device))
        v_full.append(vf.to(dtype).to(device))
    q_lens = [n for _, n in seqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        is_decode=all(n == 1 for n in q_lens),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        query_lens_cpu=q_lens,
        seq_lens_cpu=lens,
        max_seq_len=max(lens) + extra_bound,
    )

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(device)

    return dict(
        q=dev(torch.cat(qs)),
        k=dev(torch.cat(ks)),
        v=dev(torch.cat(vs)),
        k_cache=dev(k_cache),
        v_cache=dev(v_cache),
        meta=meta,
        scale=d**-0.5,
        k_full=k_full,
        v_full=v_full,
    )


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
    """Dense fp64 causal attention: gather each sequence's K/V from the paged cache. Returns [T, Hq, D]."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        k_seq, v_seq = gather_sequence(k_cache, v_cache, meta.block_table[b].cpu(), seq_len)  # [L, Hkv, D]
        k_seq = k_seq.double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v_seq = v_seq.double().repeat_interleave(hq // hkv, dim=1)
        start = sum(meta.query_lens_cpu[:b])
        qb = q[start : start + q_len].cpu().double()  # [q_len, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qb, k_seq) * scale  # [Hq, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        s = s.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v_seq)
    return out


def gather_sequence(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len tokens of one sequence from the paged cache: two [L, Hkv, D] (on CPU)."""
    page = k_cache.shape[1]
    pos = torch.arange(seq_len)
    pages = table.long()[pos // page]
    return k_cache.cpu()[pages, pos % page], v_cache.cpu()[pages, pos % page]


def run_case(case: tuple, dtype: torch.dtype, device: str, seed: int = 0) -> float:
    """Run the backend on one case, check the cache store, return the relative error vs the reference."""
    from hybridmoe.layers.attention.triton_backend import TritonAttentionBackend

    name, seqs, hq, hkv, d, page, splits, extra = case
    x = make_inputs(seqs, hq, hkv, d, page, dtype, device, extra, seed)
    meta = x["meta"]
    out = TritonAttentionBackend(num_kv_splits=splits).forward(
        x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], meta, x["scale"]
    )
    assert out.shape == x["q"].shape and out.dtype == dtype, name
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        kg, vg = gather_sequence(x["k_cache"], x["v_cache"], meta.block_table[b].cpu(), seq_len)
        assert torch.equal(kg, x["k_full"][b].cpu()) and torch.equal(vg, x["v_full"][b].cpu()), f"{name}: store"
    ref = reference_attention(x["q"], x["k_cache"], x["v_cache"], meta)
    err = ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()
    assert err == err, f"{name}: NaN in output"
    return err


def run_group(group: str, device: str) -> list[str]:
    """Run every case of a group; returns the failure messages (empty when all pass)."""
    cases, decode, dtypes = GROUPS[group]
    return run_seeded_cases(group, cases, dtypes.split(","), DTYPES, TOL, run_case, device)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_triton
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_triton_attention_interpreter(group: str) -> None:
    """Decode, prefill and half-precision cases under the Triton interpreter on CPU (subprocess)."""
    assert_interpreted(__file__, group)


def test_registered() -> None:
    """The backend registers under the name `triton`."""
    pytest.importorskip("triton")
    from hybridmoe.layers.attention.base import ATTENTION_BACKENDS
    from hybridmoe.layers.attention.triton_backend import TritonAttentionBackend

    assert ATTENTION_BACKENDS.get("triton") is TritonAttentionBackend
    assert TritonAttentionBackend().name == "triton"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("case", DECODE_CASES + PREFILL_CASES, ids=lambda c: c[0])
def test_triton_attention_gpu(case: tuple, dt: str) -> None:
    """The interpreter cases, compiled for the GPU, in every dtype."""
    err = run_case(case, DTYPES[dt], "cuda")
    assert err <= TOL[DTYPES[dt]], f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize(
    "case",
    [
        ("long_decode_auto_splits", [(4000, 1), (17, 1), (2500, 1)], 32, 8, 128, 16, None, 0),
        ("long_prefill_mixed", [(300, 200), (0, 333), (1000, 1), (64, 64)], 16, 4, 128, 16, None, 0),
        ("prefill_d80_page7", [(50, 150), (13, 3)], 6, 6, 80, 7, None, 0),
    ],
    ids=lambda c: c[0],
)
def test_triton_attention_gpu_large(case: tuple, dt: str) -> None:
    """Longer sequences on the GPU (multi-block queries, many decode splits)."""
    err = run_case(case, DTYPES[dt], "cuda")
    assert err <= TOL[DTYPES[dt]], f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_triton_decode_cuda_graph() -> None:
    """Decode captured in a CUDA graph at a max_seq_len bound, replayed with other seq_lens/tables."""
    from hybridmoe.layers.attention.triton_backend import TritonAttentionBackend

    backend, bound = TritonAttentionBackend(), 1024
    x = make_inputs([(500, 1), (9, 1), (1000, 1)], 8, 2, 64, 16, torch.bfloat16, "cuda", bound - 1001, seed=3)
    meta = x["meta"]
    static = {k: x[k].clone() for k in ("q", "k", "v")}
    backend.forward(static["q"], static["k"], static["v"], x["k_cache"], x["v_cache"], meta, x["scale"])  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static["q"], static["k"], static["v"], x["k_cache"], x["v_cache"], meta, x["scale"])
    for seed in (4, 5):  # new lengths/tables/inputs of the same shapes, copied into the captured buffers
        y = make_inputs([(700, 1), (0, 1), (300, 1)], 8, 2, 64, 16, torch.bfloat16, "cuda", seed=seed)
        y_meta = y["meta"]
        for name in ("q", "k", "v"):
            static[name].copy_(y[name])
        x["k_cache"][: y["k_cache"].shape[0]].copy_(y["k_cache"])
        x["v_cache"][: y["v_cache"].shape[0]].copy_(y["v_cache"])
        meta.seq_lens.copy_(y_meta.seq_lens)
        meta.block_table.zero_()
        meta.block_table[:, : y_meta.block_table.shape[1]].copy_(y_meta.block_table)
        meta.slot_mapping.copy_(y_meta.slot_mapping)
        graph.replay()
        ref = reference_attention(y["q"], x["k_cache"], x["v_cache"], y_meta)
        err = ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL[torch.bfloat16], f"rel err {err:.2e}"


if __name__ == "__main__":  # interpreter entry point: python tests/test_triton_attention.py GROUP [GROUP ...]
    script_main(GROUPS, run_group)
