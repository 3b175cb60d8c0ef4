"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3 style) in Triton, each kernel beside its torch reference.

Legend: M tokens (rows of x), K input features, N output features, bn x bk the weight block
(`quantization_config.weight_block_size`), Kb = ceil(K/bk), Nb = ceil(N/bn).

    y = x @ W^T,   W = w_fp8 * scale_inv[n // bn, k // bk]            (weights/fp8.py)

The activation is quantized on the fly per token and per group of bk consecutive features
(`per_token_group_quant`): s[m, g] = max(amax, EPS) / 448, q = round_e4m3(x / s). Then every K-step
of the GEMM covers exactly one group, so its fp32 partial product is scaled once by
s[m, g] * scale_inv[n // bn, g] before it is added to the accumulator (`w8a8_block_gemm`).

Error budget: e4m3 keeps 3 mantissa bits, so each quantized activation is off by up to 2^-4 of its
value (~2-3% rms over a group); the GEMM against the reference that quantizes x the same way
(`w8a8_block_gemm_ref`) differs only by fp32 summation order.

Why the rounding to e4m3 is done by hand (`_round_e4m3`): the Triton interpreter (Triton 3.9, the
CPU tests) rounds fp32 -> fp8 wrongly where rounding carries into the exponent (7.87 -> 4.0). The
value is first rounded to the e4m3 grid in fp32 (round half to even, as torch and the hardware
do), after which the cast is exact on every backend; a few integer ops in a memory-bound kernel.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the references still work
    HAVE_TRITON = False

E4M3_MAX = 448.0
EPS = 1e-10  # amax floor: an all-zero group gets a tiny scale and zero codes, never a division by 0


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether the Triton W8A8 kernels run here: CUDA with FP8 tensor cores (sm_89+), or the interpreter."""
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_block_ok(block: tuple[int, int]) -> bool:
    """The kernels take one K group per step: bk must be a power of two >= 16 (tl.dot, tl.arange)."""
    bk = block[1]
    return bk >= 16 and bk & (bk - 1) == 0 and block[0] >= 1


# ---------------------------------------------------------------- references (torch)
def per_token_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], s float32 [M, ceil(K/group)]) with x ~ q * s per group."""
    m, k = x.shape
    kb = -(-k // group)
    xp = torch.nn.functional.pad(x.float(), (0, kb * group - k)).view(m, kb, group)
    amax = xp.abs().amax(dim=-1).clamp(min=EPS)  # [M, Kb]
    # a tensor divisor: torch on CUDA turns division by a Python scalar into a multiplication by its
    # reciprocal (an ulp off at times); this way s is amax / 448 correctly rounded on every device
    s = amax / torch.full_like(amax, E4M3_MAX)
    q = (xp / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, kb * group)[:, :k].contiguous(), s


def dequant_groups(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of per_token_group_quant: float32 [M, K]."""
    k = q.shape[1]
    return q.float() * s.repeat_interleave(group, dim=1)[:, :k]


def w8a8_block_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same product as `w8a8_block_gemm` in plain torch: x quantized per token group exactly as the
    kernel does, both operands dequantized to fp32, one matmul. x [M, K], weight fp8 [N, K] -> [M, N]."""
    from hybridmoe.weights.fp8 import block_dequant

    q, s = per_token_group_quant_ref(x, block[1])
    y = dequant_groups(q, s, block[1]) @ block_dequant(weight, scale_inv, block).T
    return y.to(out_dtype or x.dtype)


# ---------------------------------------------------------------- Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _round_e4m3(x):
        """fp32 x with |x| <= 448 -> the nearest e4m3 value (ties to even), still fp32 (see module doc)."""
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        # normals: keep the top 3 of 23 mantissa bits; adding 0x7FFFF + lsb rounds half to even, and a
        # carry into the exponent is the correct result
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
        # subnormals (|x| < 2^-6) are multiples of 2^-9: at 1.5 * 2^14 the fp32 ulp is 2^-9, so the
        # add rounds (half to even) to that grid and the subtract is exact
        sub = (a + 24576.0) - 24576.0
        r = tl.where(a < 0.015625, sub, normal)
        return tl.where(x < 0, -r, r)  # the sign last: a tiny negative value rounds to -0, as in torch

    @triton.jit
    def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, Kb, stride_xm, stride_qm,
                            GROUP: tl.constexpr, EPS_: tl.constexpr, FMAX: tl.constexpr):
        """One program per (row, group): s = max(amax, EPS) / 448, q = round_e4m3(x / s)."""
        m = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), EPS_), FMAX)
        # IEEE division (div_rn), as torch divides: Triton's `/` on fp32 is the approximate division on
        # CUDA, one ulp off at times, which moves values across e4m3 rounding ties (seen on the H200:
        # codes differing from the torch reference's, 4e-3 relative max error in the GEMM)
        y = tl.minimum(tl.maximum(tl.div_rn(x, s), -FMAX), FMAX)
        tl.store(q_ptr + m * stride_qm + offs, _round_e4m3(y).to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + m * Kb + g, s)

    @triton.jit
    def _w8a8_block_gemm_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr,
        M, N, K, Kb,
        stride_am, stride_wn, stride_ym, stride_wsn,
        stride_ys, groups_per_split,  # split-K: program_id(1) sums groups [s*gps, (s+1)*gps) into y + s*stride_ys
        BN_W: tl.constexpr,  # weight block rows (bn)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K = bk: one group a step
        GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # grouped order: GROUP_M row tiles visit the same weight tiles together (L2 reuse at large M)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]: W^T tile
        as_ptrs = as_ptr + offs_m.to(tl.int64) * Kb  # [BM] scale of group 0
        ws_ptrs = ws_ptr + (offs_n // BN_W) * stride_wsn  # [BN] the weight block row of each column
        g0 = tl.program_id(1) * groups_per_split
        g1 = tl.minimum(g0 + groups_per_split, Kb)
        a_ptrs += g0 * BLOCK_K
        w_ptrs += g0 * BLOCK_K

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(g0, g1):
            k_left = K - g * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            a_s = tl.load(as_ptrs + g, mask=mask_m, other=0.0)
            w_s = tl.load(ws_ptrs + g, mask=mask_n, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + tl.program_id(1).to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym \
            + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def per_token_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of per_token_group_quant_ref: x [M, K] (rows contiguous) -> (q fp8 [M, K], s f32 [M, Kb])."""
    m, k = x.shape
    kb = -(-k // group)
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m and k:
        _group_quant_kernel[(m, kb)](x, q, s, k, kb, x.stride(0), q.stride(0), GROUP=group, EPS_=EPS,
                                     FMAX=E4M3_MAX, num_warps=1 if group <= 256 else 4)
    return q, s


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by M: decode streams the weight with narrow row
    tiles and many programs; prefill uses large tiles for reuse."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 32, 64, 4, 4
    if m <= 256:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


_SM_COUNT: dict[int, int] = {}


def _split_k(m: int, n_tiles: int, kb: int, device: torch.device) -> int:
    """K splits for a small-M GEMM: decode-sized products of a narrow N (DeepSeek-V3's kv_a_proj: N 576 =
    9 tiles of 64) would otherwise run a handful of programs, each streaming all of K alone, far from the
    memory bandwidth. Enough splits for ~2 programs per SM, each at least 4 K groups long."""
    if m > 16 or device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    want = max(1, (2 * _SM_COUNT[idx]) // max(1, n_tiles))
    return max(1, min(want, kb // 4))


def w8a8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                    out_dtype: torch.dtype | None = None, split_k: int | None = None) -> torch.Tensor:
    """y = x @ W^T with W = weight (fp8 [N, K]) * scale_inv [Nb, Kb] in (bn, bk) blocks; x [M, K] is
    quantized per token group of bk on the fly. Returns [M, N] in out_dtype (default x.dtype).
    split_k: K cut into that many ranges summed in fp32 (default: _split_k's choice; 1 on the CPU).
    No host synchronization (graph-capturable)."""
    bn, bk = block
    m, k = x.shape
    n = weight.shape[0]
    kb = -(-k // bk)
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight must be [N, K] with contiguous rows"
    assert tuple(scale_inv.shape) == (-(-n // bn), kb), "scale_inv must be [ceil(N/bn), ceil(K/bk)]"
    assert kernel_block_ok(block), f"block {block}: bk must be a power of two >= 16"
    scale_inv = scale_inv.contiguous()  # a no-op for the module's own tensor (the kernel steps by 1 along Kb)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    q, s = per_token_group_quant(x, bk)
    bm, bnt, warps, stages = _tiles(m)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bnt)
    splits = max(1, min(split_k or _split_k(m, tiles, kb, x.device), kb))
    gps = -(-kb // splits)
    splits = -(-kb // gps)  # no empty split
    dst = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
    _w8a8_block_gemm_kernel[(tiles, splits)](
        q, s, weight, scale_inv, dst, m, n, k, kb, q.stride(0), weight.stride(0), dst.stride(-2), scale_inv.stride(0),
        dst.stride(0) if splits > 1 else 0, gps,
        BN_W=bn, BLOCK_M=bm, BLOCK_N=bnt, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    if splits > 1:
        torch.sum(dst, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(dst.sum(dim=0))
    return y
