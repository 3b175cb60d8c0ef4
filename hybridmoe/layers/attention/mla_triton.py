"""MLA decode in the weight-absorbed form over the paged latent cache: a Triton kernel; its torch reference
(mla_decode_ref, in mla_ref.py: no triton import there) is re-exported here.

Legend: B sequences (one new token each), H query heads, Lkv latent width (kv_lora_rank, 512 for
DeepSeek-V3), R rope width (qk_rope_head_dim, 64), N pages in the pool, S page size, P pages per
sequence in the block table, X the number of context splits of the kernel.

The cache holds one row per token, shared by all heads: kv_cache[page, offset] = [c_kv (Lkv) | k_pe (R)]
(the contract with the model layer, layers/attention/mla.py). Token j of sequence b lives at kv_cache[block_table[b, j // S], j % S].
For every head h, with the query already absorbed into the latent space by the model layer:

    score[b, h, j] = (q_lat[b, h] . c_kv[b, j] + q_rope[b, h] . k_pe[b, j]) * scale,   j < seq_lens[b]
    o_lat[b, h]    = sum_j softmax_j(score[b, h]) * c_kv[b, j]

Because the latent row is shared, one program takes a block of BLOCK_H heads of one sequence and one
split of its context and reads each cache row once for all of them: the scores are a [BLOCK_H, BLOCK_N]
tl.dot over the latent width and the output a [BLOCK_H, Lkv] tl.dot over the tokens (flash decoding,
online softmax in fp32). A second kernel merges the X partial results by their log-sum-exp.

The split count X comes from static shapes only (B, H, P, S and the SM count); each program derives
its own token range from seq_lens[b] on the device, so a call reads no host value and launches the
same grid for any lengths: it can be captured in a CUDA graph and replayed with new seq_lens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridmoe.layers.attention.mla_ref import check_decode_inputs, mla_decode_ref
from hybridmoe.layers.attention.triton_kernels import _LOG2E, _dot, _dot_fp32, _num_sms

# Kernel signatures and launches keep several arguments a line (denser than the formatter's one a line).
# fmt: off


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, num_splits,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_kn, stride_ks, stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, LKV: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, TRANS: tl.constexpr,
):
    """One program: sequence b, heads hb * BLOCK_H ..., context split `split` of X.

    TRANS computes the transposed products, scores^T [BLOCK_N, BLOCK_H] = c_kv . q^T and
    o^T [BLOCK_L, BLOCK_H] += c_kv^T . p^T, with the softmax along axis 0: the tokens are the M of the
    score dot and the latent width the M of the value dot, so the warps split both along M (the
    untransposed chain has M = heads for both dots, and with 64 heads both warpgroups compute the same
    score tile). Same arithmetic, same results up to summation order.

    The split covers tokens [split * split_len, (split + 1) * split_len) clipped to seq_lens[b], with
    split_len = ceil(seq_len / X) rounded up to BLOCK_N, so a sequence's work spreads over all X
    programs whatever its length (some stay empty when seq_len < X * BLOCK_N). Without SPLIT (X == 1)
    the program writes the output; otherwise the normalized partial output and its log-sum-exp (base 2)
    go to part_out [B, H, X, Lkv] (fp32 or the model dtype) / part_lse [B, H, X] (fp32). X is a runtime value so that the batch sizes of
    the engine's CUDA graphs (each its own X) share one compiled kernel.
    """
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < NUM_HEADS
    l_mask = offs_l < LKV
    r_mask = offs_r < ROPE
    q = tl.load(q_lat_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_l[None, :],
                mask=h_mask[:, None] & l_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_L]
    q_pe = tl.load(q_rope_ptr + b * stride_rb + heads[:, None] * stride_rh + offs_r[None, :],
                   mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if TRANS:
        acc = tl.zeros([BLOCK_L, BLOCK_H], tl.float32)  # o_lat^T
        q_t = tl.trans(q)  # [BLOCK_L, BLOCK_H]
        q_pe_t = tl.trans(q_pe)  # [BLOCK_R, BLOCK_H]
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n  # [BLOCK_N]
        tok_mask = tok < hi
        # Masked tokens read page 0 (scratch) offsets and are masked out of the loads anyway.
        page = tl.load(block_table_ptr + b * stride_bt + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
        row = page * stride_kn + (tok % PAGE_SIZE).to(tl.int64) * stride_ks  # [BLOCK_N] row offsets
        c_kv = tl.load(kv_ptr + row[:, None] + offs_l[None, :],
                       mask=tok_mask[:, None] & l_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_L]
        k_pe = tl.load(kv_ptr + row[:, None] + LKV + offs_r[None, :],
                       mask=tok_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        if TRANS:
            s = _dot(c_kv, q_t, DOT_FP32) + _dot(k_pe, q_pe_t, DOT_FP32)  # [BLOCK_N, BLOCK_H]
            s = tl.where(tok_mask[:, None], s * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha[None, :] + _dot(tl.trans(c_kv), p.to(q.dtype), DOT_FP32)
        else:
            s = _dot(q, tl.trans(c_kv), DOT_FP32) + _dot(q_pe, tl.trans(k_pe), DOT_FP32)  # [BLOCK_H, BLOCK_N]
            s = tl.where(tok_mask[None, :], s * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(q.dtype), c_kv, DOT_FP32)  # the values are the latent itself
        m_i = m_new

    if TRANS:
        acc = tl.trans(acc)  # [BLOCK_H, BLOCK_L]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or seq_len 0) leaves zeros
    io_mask = h_mask[:, None] & l_mask[None, :]
    if not SPLIT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (b * NUM_HEADS + heads).to(tl.int64) * num_splits + split  # [BLOCK_H] rows of [B, H, X]
        tl.store(part_out_ptr + part[:, None] * LKV + offs_l[None, :], out.to(part_out_ptr.dtype.element_ty),
                 mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)


@triton.jit
def _mla_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, LKV: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_X: tl.constexpr,
):
    """One program: sequence b, head h. Merges the X partial outputs, each weighted by 2^(lse - max).

    BLOCK_X split rows a step ([BLOCK_X, Lkv] loads; _REDUCE_BLOCK_X says which measured best). The partials
    may be fp32 or the model dtype; the sums are fp32."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * NUM_HEADS + h).to(tl.int64) * num_splits
    offs_l = tl.arange(0, BLOCK_L)
    offs_x = tl.arange(0, BLOCK_X)
    l_mask = offs_l < LKV
    m = tl.full([BLOCK_X], float("-inf"), tl.float32)
    for x0 in range(0, num_splits, BLOCK_X):
        m = tl.maximum(m, tl.load(part_lse_ptr + row + x0 + offs_x, mask=x0 + offs_x < num_splits,
                                  other=float("-inf")))
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every split empty (seq_len 0): zeros
    total = tl.zeros([BLOCK_X], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for x0 in range(0, num_splits, BLOCK_X):
        x_mask = x0 + offs_x < num_splits
        w = tl.exp2(tl.load(part_lse_ptr + row + x0 + offs_x, mask=x_mask, other=float("-inf")) - m_all)  # empty: 0
        total += w
        part = tl.load(part_out_ptr + (row + x0 + offs_x)[:, None] * LKV + offs_l[None, :],
                       mask=x_mask[:, None] & l_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_X, BLOCK_L]
        acc += tl.sum(w[:, None] * part, 0)
    t = tl.sum(total, 0)
    out = acc / tl.where(t > 0, t, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_l, out.to(out_ptr.dtype.element_ty), mask=l_mask)


# fmt: on


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tile of the decode kernel: heads per program, tokens per step, warps, software-pipeline stages."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    transposed: bool = False  # the kernel's TRANS form


# Keyed by (element bytes, padded latent width >= 256). bf16/fp16 at Lkv 512: the kernel is tensor-core
# bound at H 128 (2 * H * (2 * Lkv + R) FLOP per (Lkv + R) * 2 cache bytes: about 240 FLOP/B), so a program
# takes 64 heads, the M of one Hopper wgmma (H 128 then reads each row twice, the second time mostly from
# L2), with 8 warps: the PV dot splits its N = 512 over the two warpgroups, 128 fp32 accumulator registers
# a thread. Triton gives the score dot all 8 warps along M (its rule for a dot that feeds another), so
# both warpgroups compute the same [64, BLOCK_N] scores. The transposed form (TRANS) avoids that but
# spills more (its p^T goes through shared memory): on the H200 (bench_mla_decode.py --sweep, session 8,
# B 1/16/64 x 8K/32K, kernel cache-bytes ratio to the copy bandwidth, geometric mean) the plain
# (64, 64, 8w, 2st) tile was best at 0.256, (64, 16, 8w, 2st) 0.137, the best transposed tile ~0.21.
_CONFIGS: dict[tuple[int, bool], MLADecodeConfig] = {
    (2, True): MLADecodeConfig(64, 64, 8, 2),
    (2, False): MLADecodeConfig(64, 32, 4, 2),
    (4, True): MLADecodeConfig(16, 16, 4, 1),
    (4, False): MLADecodeConfig(32, 16, 4, 2),
}
_INTERPRET_CONFIG = MLADecodeConfig(16, 16, 4, 1)


def decode_config(dtype: torch.dtype, lkv: int, num_heads: int, interpret: bool) -> MLADecodeConfig:
    """The default tile for these sizes; block_h shrinks to the head count (at least 16, tl.dot's minimum)."""
    cfg = _INTERPRET_CONFIG if interpret else _CONFIGS[(4 if dtype == torch.float32 else 2, _pad(lkv) >= 256)]
    block_h = min(cfg.block_h, _pad(num_heads))
    return MLADecodeConfig(block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.transposed)


def _pad(n: int) -> int:
    """Power of two >= n and >= 16 (tl.arange needs a power of two, tl.dot at least 16)."""
    return max(16, triton.next_power_of_2(n))


# The merge's split rows a step, and the dtype of the splits' normalized partial outputs (None: the input's; the
# merge adds them in fp32). At batch 1 the partials are as many bytes as the cache (B * H * X * Lkv against
# B * ctx * (Lkv + R)): halving them, with one row a step, measured best (H100 host, session 27,
# results/session27/mla_split_probe.py: B 1 x 8K kernel 25.9 us at X 64 against 33.6 us before, fp32 partials
# at X 43 with 8 rows a step; 8 rows a step did not pay with bf16 partials, nor at B 16).
_REDUCE_BLOCK_X = 1
# Under the interpreter (tests on the CPU) a step of the merge costs its Python ops however few rows it loads: 4 rows
# a step keep a multi-step merge in the tests (X up to 11) at a quarter of the steps.
_INTERPRET_REDUCE_BLOCK_X = 4
_PARTIAL_DTYPE: torch.dtype | None = None

# Rates of choose_num_splits' time model (H200-like guesses; only their ratios matter, and only roughly).
_PROGRAM_FLOPS = 2.5e12  # tensor-core FLOP/s of one program (one an SM: ~330 TFLOP/s over 132 SMs)
_PARTIAL_BW = 3.0e12  # B/s for the partial results, written by the splits and read by the merge
_MERGE_S = 3e-6  # the merge kernel's launch and tail
_FIXED_TOKENS = 32  # a program's fixed work (q tile load, epilogue) in tokens' worth of its compute


@functools.lru_cache(maxsize=1024)  # eager decode calls it once a layer a step
def choose_num_splits(num_seqs: int, num_heads: int, lkv: int, rope: int, max_tokens: int, cfg: MLADecodeConfig,
                      num_sms: int, max_splits: int = 64, partial_bytes: int = 2) -> int:
    """Context splits X from static sizes only: the X of least modeled time for sequences of max_tokens.

    Time(X) = waves * (fixed + ceil(max_tokens / X) tokens) + [X > 1] * (merge launch + partial traffic),
    where the num_seqs * ceil(H / block_h) * X programs run one an SM (the bf16 tile's shared memory
    allows one) in ceil(programs / num_sms) waves, a token costs a program 2 * block_h * (2 Lkv + R) FLOP,
    and the partials are B * H * X * Lkv elements of partial_bytes (the input dtype's: 2 for bf16) written
    once and read once. At a batch that fills the
    SMs this gives X = 1; at batch 1 a few dozen splits, fewer for short contexts, where the partials
    would outweigh the cache rows.
    """
    programs = num_seqs * triton.cdiv(num_heads, cfg.block_h)
    token_s = 2 * cfg.block_h * (2 * lkv + rope) / _PROGRAM_FLOPS
    cap = max(1, min(max_splits, triton.cdiv(max(max_tokens, 1), cfg.block_n)))
    best, best_t = 1, float("inf")
    for x in range(1, cap + 1):
        split_tokens = triton.cdiv(triton.cdiv(max_tokens, x), cfg.block_n) * cfg.block_n
        t = triton.cdiv(programs * x, num_sms) * (_FIXED_TOKENS + split_tokens) * token_s
        if x > 1:
            t += _MERGE_S + num_seqs * num_heads * x * lkv * 2 * partial_bytes / _PARTIAL_BW
        if t < best_t:
            best, best_t = x, t
    return best


def mla_decode(
    q_lat: torch.Tensor,  # [B, H, Lkv]
    q_rope: torch.Tensor,  # [B, H, R]
    kv_cache: torch.Tensor,  # [N, S, Lkv + R]
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32 (cached + new), >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, Lkv]
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:  # [B, H, Lkv], dtype of q_lat (of `out` when given)
    """Absorbed MLA decode attention of one new token per sequence over the paged latent cache.

    Reads no host value and sizes its grid from shapes only: CUDA-graph capturable.

    Args:
        max_seq_len: a static bound on seq_lens (e.g. a CUDA graph's), used only to choose the split
            count; default P * S, the most the block table can address.
        num_splits: force the split count X (tests, tuning).
        config: force the tile (tests, tuning); default `decode_config`.
    """
    bsz, heads, lkv, rope = check_decode_inputs(q_lat, q_rope, kv_cache, block_table, seq_lens)
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    assert kv_cache.stride(-1) == 1, "kv_cache rows must be contiguous"
    if out is None:
        out = torch.empty(bsz, heads, lkv, dtype=q_lat.dtype, device=q_lat.device)
    assert out.shape == (bsz, heads, lkv) and out.stride(-1) == 1, "out must be [B, H, Lkv] with contiguous rows"
    if bsz == 0 or heads == 0:
        return out
    interpret = q_lat.device.type != "cuda"
    cfg = config or decode_config(q_lat.dtype, lkv, heads, interpret)
    page = kv_cache.shape[1]
    head_blocks = triton.cdiv(heads, cfg.block_h)
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_table.shape[1] * page
        num_splits = choose_num_splits(bsz, heads, lkv, rope, bound, cfg, _num_sms(q_lat.device),
                                       partial_bytes=q_lat.element_size())
    if num_splits > 1:
        part_out = torch.empty(bsz, heads, num_splits, lkv, dtype=_PARTIAL_DTYPE or q_lat.dtype, device=q_lat.device)
        part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q_lat.device)
    else:
        part_out = part_lse = out  # unused
    block_l = _pad(lkv)
    # fmt: off
    _mla_decode_kernel[(bsz, head_blocks, num_splits)](
        q_lat, q_rope, kv_cache, block_table, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, num_splits,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=heads, LKV=lkv, ROPE=rope, PAGE_SIZE=page, SPLIT=num_splits > 1,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_L=block_l, BLOCK_R=_pad(rope), DOT_FP32=_dot_fp32(q_lat),
        TRANS=cfg.transposed,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _mla_reduce_kernel[(bsz, heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=heads, LKV=lkv, BLOCK_L=block_l,
            BLOCK_X=_INTERPRET_REDUCE_BLOCK_X if interpret else _REDUCE_BLOCK_X, num_warps=4,
        )
    # fmt: on
    return out


__all__ = ["MLADecodeConfig", "choose_num_splits", "decode_config", "mla_decode", "mla_decode_ref"]
