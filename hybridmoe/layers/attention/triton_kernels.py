"""Triton kernels for attention over the paged KV cache, and their launchers.

Legend: T new tokens in the batch, B sequences, Hq query heads, Hkv key/value heads, G = Hq // Hkv
(the GQA group), D head dim, N pages in the pool, S page size, P pages per sequence in the block
table, X the number of KV splits of the decode kernel.

Token j of sequence b lives at k_cache[block_table[b, j // S], j % S]. Every kernel gathers its
keys and values token by token through the block table, so any page size works (1, 16, 3, ...),
and pads the head dim to a power of two with masks (48, 80, ...). Scores, softmax and the output
accumulate in fp32; the new tokens of sequence b sit at positions seq_len - q_len .. seq_len - 1.

Only features of Triton 3.0+ are used (the production host runs Triton 3.6); the kernels run under
the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634

# Kernel signatures and launches keep several arguments a line (denser than the formatter's one a line).
# fmt: off


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_ptr, b, kvh, tok, tok_mask, offs_d, d_mask,
    stride_bt, stride_n, stride_s, stride_h,
    PAGE_SIZE: tl.constexpr,
):
    """Gather the rows of tokens `tok` [BLOCK_N] of sequence b, head kvh: [BLOCK_N, BLOCK_D]."""
    page = tl.load(block_table_ptr + b * stride_bt + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
    row = page * stride_n + (tok % PAGE_SIZE).to(tl.int64) * stride_s + kvh * stride_h
    ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=tok_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a @ b accumulated in fp32; DOT_FP32: operands in fp32 with IEEE precision (no TF32)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b.to(a.dtype))


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, split_len,
    stride_qt, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program: sequence b, KV head kvh (all G query heads of its group), KV split `split`.

    Attends the single new query token of b over tokens [split * split_len, (split+1) * split_len)
    clipped to seq_lens[b]. With NUM_SPLITS == 1 it writes the output; otherwise the normalized
    partial output and its log-sum-exp (base 2) go to part_out [B, Hq, X, D] / part_lse [B, Hq, X].
    Reads only device tensors, so it can be captured in a CUDA graph.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] head within the group
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h  # query heads
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        tok_mask = tok < hi
        k = _load_kv_tile(k_cache_ptr, block_table_ptr, b, kvh, tok, tok_mask, offs_d, d_mask,
                          stride_bt, stride_kn, stride_ks, stride_kh, PAGE_SIZE)
        v = _load_kv_tile(v_cache_ptr, block_table_ptr, b, kvh, tok, tok_mask, offs_d, d_mask,
                          stride_bt, stride_vn, stride_vs, stride_vh, PAGE_SIZE)
        s = _dot(q, tl.trans(k), DOT_FP32)
        s = tl.where(tok_mask[None, :], s * scale_log2e, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_FP32)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    io_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        row = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_H] into [B, Hq, X]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: sequence b, query head h. Merges the X partial outputs by their weights."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_x = tl.arange(0, BLOCK_X)
    offs_d = tl.arange(0, BLOCK_D)
    x_mask = offs_x < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_x, mask=x_mask, other=float("-inf"))  # [BLOCK_X]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): output zeros
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + (row * NUM_SPLITS + offs_x)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=x_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_X, BLOCK_D]
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, q_pos, start, kv_end, k_cache_ptr, v_cache_ptr, block_table_ptr, b, kvh, offs_d, d_mask,
    scale_log2e, stride_bt, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One online-softmax step over keys start .. start + BLOCK_N - 1; CAUSAL masks key > query position."""
    tok = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    tok_mask = tok < kv_end
    k = _load_kv_tile(k_cache_ptr, block_table_ptr, b, kvh, tok, tok_mask, offs_d, d_mask,
                      stride_bt, stride_kn, stride_ks, stride_kh, PAGE_SIZE)
    v = _load_kv_tile(v_cache_ptr, block_table_ptr, b, kvh, tok, tok_mask, offs_d, d_mask,
                      stride_bt, stride_vn, stride_vs, stride_vh, PAGE_SIZE)
    s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2e  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        s = tl.where((tok[None, :] <= q_pos[:, None]) & tok_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_FP32)
    return acc, l_i, m_new


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program: query block mblk of sequence b, query head h (flash attention, online softmax).

    Query row i of the block is new token mblk * BLOCK_M + i, at position ctx + that, where
    ctx = seq_len - q_len is the cached prefix; it sees keys 0 .. its position. Programs whose
    block lies past the sequence's q_len run no iterations and store nothing.
    """
    mblk = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = ctx + offs_m

    # Keys past the block's last query position are never seen; an inactive block runs no loop.
    kv_end = tl.minimum(seq_len, ctx + (mblk + 1) * BLOCK_M)
    kv_end = tl.where(mblk * BLOCK_M < q_len, kv_end, 0)

    # Tiles wholly before the block's first query position need no causal mask; the rest do.
    full_end = tl.minimum(seq_len, ctx + mblk * BLOCK_M) // BLOCK_N * BLOCK_N
    full_end = tl.minimum(full_end, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, q_pos, start, kv_end, k_cache_ptr, v_cache_ptr, block_table_ptr, b, kvh, offs_d,
            d_mask, scale_log2e, stride_bt, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            PAGE_SIZE, BLOCK_N, False, DOT_FP32)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, q_pos, start, kv_end, k_cache_ptr, v_cache_ptr, block_table_ptr, b, kvh, offs_d,
            d_mask, scale_log2e, stride_bt, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            PAGE_SIZE, BLOCK_N, True, DOT_FP32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_fp32(q: torch.Tensor) -> bool:
    """Dots in fp32 for fp32 inputs, and for bf16 under the interpreter, whose bf16 tl.dot multiplies
    the raw bit patterns (triton-lang/triton#11584: bf16 dots are unsupported there)."""
    return q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type != "cuda")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      block_n: int, min_split_tokens: int = 256, max_splits: int = 64) -> int:
    """Decode KV splits from shapes and the max_seq_len bound only: enough programs to fill the GPU
    (about 2 per SM), each split at least `min_split_tokens` long."""
    want = triton.cdiv(2 * _num_sms(device), max(1, num_seqs * num_kv_heads))
    cap = max(1, triton.cdiv(max_seq_len, max(block_n, min_split_tokens)))
    return max(1, min(want, cap, max_splits))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per sequence
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Flash-decoding over the paged cache: X splits of the KV range, then a log-sum-exp merge.

    Grid sizes depend on shapes and max_seq_len only, and no host value is read: CUDA-graph safe.
    """
    q = _last_dim_contiguous(q)
    bsz, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache head dim must be contiguous"
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    group = hq // hkv
    out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    interp = q.device.type != "cuda"
    block_n = block_n or (16 if interp else 64)
    if num_splits is None:
        num_splits = choose_num_splits(bsz, hkv, max_seq_len, q.device, block_n)
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_seq_len, 1), split_len))
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(16, triton.next_power_of_2(group))
    if num_splits > 1:
        part_out = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _paged_decode_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page, NUM_SPLITS=num_splits,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=_dot_fp32(q),
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(bsz, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_X=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def prefill_config(dtype: torch.dtype, block_d: int, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel."""
    if interpret:
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    # Measured on an H200 (bf16, D=128, GQA 4): 64x64, 4 warps gave ~290-335 TFLOP/s, the best of 7 configs.
    return (64, 64, 4, 2) if block_d <= 128 else (64, 32, 4, 2)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    max_query_len: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal flash attention of the packed new tokens over their sequences' paged KV."""
    q = _last_dim_contiguous(q)
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache head dim must be contiguous"
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    bsz = seq_lens.shape[0]
    if t == 0 or bsz == 0 or max_query_len <= 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    cfg_m, cfg_n, warps, stages = prefill_config(q.dtype, block_d, q.device.type != "cuda")
    block_m, block_n = block_m or cfg_m, block_n or cfg_n
    grid = (triton.cdiv(max_query_len, block_m), bsz, hq)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, PAGE_SIZE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=_dot_fp32(q),
        num_warps=warps, num_stages=stages,
    )
    return out


__all__ = ["choose_num_splits", "paged_decode_attention", "paged_prefill_attention"]
