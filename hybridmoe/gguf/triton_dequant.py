"""GGUF blocks -> dense rows on the GPU: one Triton kernel for Q4_0, Q8_0, Q4_K, Q5_K, Q6_K and
IQ4_XS, with `hybridmoe.cpu.gguf_quant.dequantize` (torch, fp32) as its reference.

Legend: E experts (leading matrices), N rows of a matrix, K values per row, RB bytes per row,
BS values / TS bytes per block of the type (gguf_quant.TYPES), NB blocks per program.

    dequantize_into(blocks, "Q4_K", out)     # blocks uint8 [E, N, RB] -> out [E, N, K] (bf16, f16, f32)

Used by the layerwise GPU prefill (moe/layerwise.py): a layer's CPU-resident GGUF experts are copied
as their raw blocks into a staging buffer on the GPU and dequantized there straight into the layer
buffer, no fp32 temporaries. The block layouts are documented in cpu/gguf_quant.py.

Exactness: the kernel evaluates the reference's formulas in fp32 and every product in them is exact
or rounded once (fp16 scales have 11 significant bits, the 6-bit sub-scales and <= 6-bit codes add at
most 14 more, so d*sc*q and dmin*m fit in fp32's 24 bits; Q6_K and IQ4_XS multiply three factors with
one rounding of the exact product whichever the order), so the result is the reference's fp32 value
bit for bit, fused multiply-adds or not. The conversion to bf16 is done by hand (round to nearest
even on the fp32 bits, stored as 16-bit words) because the Triton interpreter's fp32 -> bf16 cast
does not round like torch's; so `out` equals `reference.to(out.dtype)` exactly on every backend.
"""

from __future__ import annotations

import os

import torch

from hybridmoe.cpu import gguf_quant

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the reference still works
    HAVE_TRITON = False

# blocks per program by block size: ~2048 values a program
_NB = {32: 64, 256: 8}
CPU_CHUNK_ELEMS = 1 << 24  # values dequantized at a time by the torch path (bounds its fp32 temporaries)


def use_triton(t: torch.Tensor) -> bool:
    """The kernel runs on CUDA tensors, and on CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if HAVE_TRITON:

    @triton.jit
    def _byte(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _f16(ptr, mask):
        """Little-endian fp16 at ptr -> fp32 (exact)."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _signed(b):
        """A byte (0..255, int32) read as int8."""
        return b - ((b & 128) << 1)

    @triton.jit
    def _gguf_dequant_kernel(src, dst, kv, src_estride, dst_estride, nblocks,
                             TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NB: tl.constexpr,
                             OUT_BF16: tl.constexpr):
        e = tl.program_id(1).to(tl.int64)
        blk = tl.program_id(0) * NB + tl.arange(0, NB)  # [NB] block index within the expert
        v = tl.arange(0, BS)[None, :]  # [1, BS] value index within a block
        bm = (blk < nblocks)[:, None]  # [NB, 1]
        m = bm & (v >= 0)  # [NB, BS]
        blk64 = blk.to(tl.int64)[:, None]
        p = src + e * src_estride + blk64 * TS  # [NB, 1] block starts
        if TYPE == 2:  # Q4_0: d, qs[16]; value v = nibble v // 16 of qs[v % 16]
            q = (_byte(p + 2 + (v % 16), m) >> (4 * (v // 16))) & 15
            w = _f16(p, bm) * (q - 8).to(tl.float32)
        elif TYPE == 8:  # Q8_0: d, qs int8[32]
            w = _f16(p, bm) * _signed(_byte(p + 2 + v, m)).to(tl.float32)
        elif TYPE == 12 or TYPE == 13:  # Q4_K / Q5_K: d, dmin, scales[12], (qh[32]), qs[128]
            j = v // 32  # sub-block
            jl = j % 4
            lo = j < 4
            s_a = _byte(p + 4 + jl, m)  # scales[j % 4]
            s_b = _byte(p + 8 + jl, m)  # scales[4 + j % 4]
            s_c = _byte(p + 12 + jl, m)  # scales[8 + j % 4]
            sc = tl.where(lo, s_a & 63, (s_c & 15) | ((s_a >> 2) & 48))
            mn = tl.where(lo, s_b & 63, (s_c >> 4) | ((s_b >> 2) & 48))
            qoff = 48 if TYPE == 13 else 16
            q = (_byte(p + qoff + 32 * (v // 64) + (v % 32), m) >> (4 * (j % 2))) & 15
            if TYPE == 13:
                q = q | (((_byte(p + 16 + (v % 32), m) >> j) & 1) << 4)
            w = _f16(p, bm) * sc.to(tl.float32) * q.to(tl.float32) - _f16(p + 2, bm) * mn.to(tl.float32)
        elif TYPE == 14:  # Q6_K: ql[128], qh[64], scales int8[16], d
            h = v // 128
            r = v % 128
            low = (_byte(p + 64 * h + (r % 64), m) >> (4 * (r // 64))) & 15
            high = (_byte(p + 128 + 32 * h + (r % 32), m) >> (2 * (r // 32))) & 3
            sc = _signed(_byte(p + 192 + v // 16, m))
            w = _f16(p + 208, bm) * sc.to(tl.float32) * ((low | (high << 4)) - 32).to(tl.float32)
        else:  # IQ4_XS (23): d, scales_h u16, scales_l[4], qs[128]; codes index a 16-value table
            j = v // 32
            ll = v % 32
            sh = _byte(p + 2, m) | (_byte(p + 3, m) << 8)
            ls = ((_byte(p + 4 + j // 2, m) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
            q = (_byte(p + 8 + 16 * j + (ll % 16), m) >> (4 * (ll // 16))) & 15
            w = _f16(p, bm) * (ls - 32).to(tl.float32) * tl.load(kv + q, mask=m, other=0)
        out = dst + e * dst_estride + blk64 * BS + v
        if OUT_BF16:  # round to nearest even by hand (see the module docstring), stored as int16 words
            bits = w.to(tl.uint32, bitcast=True)
            r16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
            tl.store(out, r16.to(tl.int16, bitcast=True), mask=m)
        else:
            tl.store(out, w.to(dst.dtype.element_ty), mask=m)


_KV: dict[torch.device, torch.Tensor] = {}


def _kvalues(device: torch.device) -> torch.Tensor:
    if device not in _KV:
        _KV[device] = torch.tensor(gguf_quant.IQ4_KVALUES, dtype=torch.float32, device=device)
    return _KV[device]


def _as3d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def _check(blocks: torch.Tensor, tid: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    name, bs, ts = gguf_quant.TYPES[tid]
    if blocks.dtype != torch.uint8 or blocks.dim() not in (2, 3) or out.dim() != blocks.dim():
        raise ValueError(f"{name}: blocks must be uint8 [E, N, RB] or [N, RB] and out of the same rank, got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {tuple(out.shape)}")
    b3, o3 = _as3d(blocks), _as3d(out)
    e, n, rb = b3.shape
    k = rb // ts * bs
    if rb % ts or tuple(o3.shape) != (e, n, k):
        raise ValueError(f"{name}: blocks {tuple(blocks.shape)} ({ts} bytes per {bs} values) do not match out "
                         f"{tuple(out.shape)}")
    if n and (b3.stride(2) != 1 or b3.stride(1) != rb or o3.stride(2) != 1 or o3.stride(1) != k):
        raise ValueError(f"{name}: each matrix of blocks and out must be contiguous (rows back to back)")
    if blocks.device != out.device:
        raise ValueError(f"{name}: blocks on {blocks.device}, out on {out.device}")
    return b3, o3, n * rb // ts


def dequantize_triton(blocks: torch.Tensor, t: int | str, out: torch.Tensor) -> torch.Tensor:
    """The Triton kernel: blocks uint8 [E, N, RB] (or [N, RB]) -> out [E, N, K] in bf16 / f16 / f32.
    Matrices may sit at any stride from each other (e.g. the gate half of a gate_up buffer); rows within
    one must be contiguous. Returns out."""
    if not HAVE_TRITON:
        raise RuntimeError("the GGUF dequantizing kernel needs Triton")
    tid = gguf_quant.type_id(t)
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out must be bf16, f16 or f32, got {out.dtype}")
    b3, o3, nblocks = _check(blocks, tid, out)
    e = b3.shape[0]
    if not nblocks or not e:
        return out
    _, bs, ts = gguf_quant.TYPES[tid]
    nb = _NB[bs]
    bf16 = out.dtype == torch.bfloat16
    dst = o3.view(torch.int16) if bf16 else o3
    grid = (triton.cdiv(nblocks, nb), e)
    _gguf_dequant_kernel[grid](b3, dst, _kvalues(out.device), b3.stride(0), dst.stride(0), nblocks,
                               TYPE=tid, BS=bs, TS=ts, NB=nb, OUT_BF16=bf16, num_warps=4)
    return out


def dequantize_torch(blocks: torch.Tensor, t: int | str, out: torch.Tensor) -> torch.Tensor:
    """The reference into `out` (CPU tensors), a bounded number of matrices at a time. Returns out."""
    tid = gguf_quant.type_id(t)
    b3, o3, _ = _check(blocks, tid, out)
    e, n, k = o3.shape
    step = max(1, CPU_CHUNK_ELEMS // max(1, n * k))
    for e0 in range(0, e, step):
        o3[e0:e0 + step].copy_(gguf_quant.dequantize(b3[e0:e0 + step], tid))
    return out


def dequantize_into(blocks: torch.Tensor, t: int | str, out: torch.Tensor) -> torch.Tensor:
    """GGUF blocks -> out, by the Triton kernel where it runs (`use_triton`), else the torch reference
    (the CPU device); both give reference.to(out.dtype) exactly."""
    if use_triton(blocks):
        return dequantize_triton(blocks, t, out)
    return dequantize_torch(blocks, t, out)
