"""CPU expert weight formats: reference quantizers/dequantizers and the packed layout the kernels read.

Legend: E experts, I intermediate, H hidden, N output rows, K reduction size, G int4 group size,
NB = N/16 row blocks, "p" = padded (H, I padded to a multiple of 64 and of G).

Methods (names kept from KTransformers' --kt-method; none of them needs AMX):
  AMXINT8  int8, symmetric, one fp32 scale per output row:  w = s[n] * q,  q in [-127, 127]
  AMXINT4  int4 in groups of G along K (32, 64, 128): symmetric w = d * (u - 8), u in [0, 15]
           (d = amax/7, q clamped to [-8, 7]) or asymmetric w = d * u + m (m = group min)
  BF16     bf16 weights
  FP8      float8_e4m3fn weights as the checkpoint stores them (DeepSeek-V3's block-scaled fp8), 1 byte
           per weight, with one fp32 scale per (16-row block, K group of G = the checkpoint's bk):
           w = fp8 * s. The kernels widen fp8 to bf16 in registers (exact: every e4m3 value is a bf16
           value) and take bf16 activations on every ISA; the scale multiplies each K group's partial dot.
The integer methods quantize activations per row on the fly: q = round(x * (127/amax)) in fp32,
scale = amax / 127 (`quantize_act_int8`, mirrored bit for bit by the kernels).

Packed layout (see csrc/common.h): per expert, rows in blocks of 16; inside a block, 4-byte steps
holding 4 bytes of each of the 16 rows = the AMX B-tile / AVX-512 VNNI layout. gate_up is packed
as "w13" with gate and up rows interleaved every 16 rows so one block pair yields act(g) * u.
FP8 keeps the bf16 block layout with 1 byte per value (a step = 2 K values x 16 rows, 32 bytes; widened,
one AVX-512 register, one AMX B-tile row), two steps per 64-byte line lane-interleaved for the AVX-512
byte unpacks (pack_pairs); scales [E, N/16, K/G] f32.
Everything here is torch on CPU, so `convert` can write the packed tensors and load them by mmap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridmoe.cpu.layout import (  # noqa: F401  (re-exported: tests and dequant use quant.*)
    pack_blocks,
    pack_group_params,
    pack_int4_blocks,
    pack_pairs,
    unpack_blocks,
    unpack_group_params,
    unpack_int4_blocks,
    unpack_pairs,
)
from hybridmoe.cpu.packed_assembly import PackedAssembly
from hybridmoe.weights.fp8 import FP8_DTYPES, block_dequant, block_quant

METHODS = {"AMXINT8": 0, "AMXINT4": 1, "BF16": 2, "FP8": 3}
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 1, "swiglu_clamp": 2}
GROUP_SIZES = (32, 64, 128)
FP8_DTYPE = torch.float8_e4m3fn
E4M3_NAN_BITS = 0x7F  # e4m3fn has no infinities; S.1111.111 is NaN


def check_fp8_block(block: tuple[int, int]) -> tuple[int, int]:
    """The (bn, bk) block sizes the FP8 kernels take: a scale per 16-row block and per K group that
    is a whole number of AMX tile depths (32). DeepSeek-V3 / Kimi-K2 / Qwen3 fp8 use 128 x 128."""
    bn, bk = int(block[0]), int(block[1])
    if bn < 16 or bn % 16 or bk < 32 or bk % 32:
        raise ValueError(f"--kt-method FP8 needs fp8 block sizes with bn a multiple of 16 and bk a multiple of 32 "
                         f"(DeepSeek's [128, 128] is fine); the checkpoint has weight_block_size [{bn}, {bk}]: "
                         "use another --kt-method (it dequantizes the fp8 weights)")
    return bn, bk


def method_code(method: str) -> int:
    m = method.upper()
    if m not in METHODS:
        raise ValueError(f"unknown CPU expert method {method!r}; available: {sorted(METHODS)}")
    return METHODS[m]


# ---- reference quantizers (any leading dims; rows along dim -2, K along dim -1) ----------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> q int8 [..., N, K], scale f32 [..., N]; symmetric per output row."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax.clamp_min(1e-30), torch.zeros_like(amax))
    q = torch.round(w * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = True):
    """[..., N, K] (K % G == 0) -> u uint8 [..., N, K] in [0, 15], d f32 [..., N, K/G], m f32 [..., N, K/G]."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    *lead, n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(*lead, n, k // group_size, group_size)
    if symmetric:
        d = g.abs().amax(dim=-1) / 7.0
        inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
        u = torch.round(g * inv.unsqueeze(-1)).clamp_(-8, 7) + 8
        m = -8.0 * d
    else:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        d = (hi - lo) / 15.0
        inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
        u = torch.round((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
        m = lo
    return u.to(torch.uint8).reshape(*lead, n, k), d, m


def dequantize_int4(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    *lead, n, k = u.shape
    g = u.float().reshape(*lead, n, k // group_size, group_size)
    return (g * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(*lead, n, k)


def quantize_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row activation quantization exactly as the kernels do it: [R, K] -> q int8, scale f32 [R]."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(1e-38), torch.zeros_like(amax))
    q = torch.round(x * inv.unsqueeze(-1)).to(torch.int8)
    return q, amax / 127.0


# ---- packing --------------------------------------------------------------------------------
def _pad2(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    pn, pk = n - w.shape[-2], k - w.shape[-1]
    return torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w


def interleave_w13(gate_up: torch.Tensor, ip: int, hp: int) -> torch.Tensor:
    """[E, 2I, H] (gate rows first) -> [E, 2Ip, Hp], rows: gate 0-15, up 0-15, gate 16-31, ..."""
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    gate = _pad2(gate_up[:, :i], ip, hp).reshape(e, ip // 16, 1, 16, hp)
    up = _pad2(gate_up[:, i:], ip, hp).reshape(e, ip // 16, 1, 16, hp)
    return torch.cat([gate, up], dim=2).reshape(e, 2 * ip, hp)


def deinterleave_w13(w13: torch.Tensor, i: int, h: int) -> torch.Tensor:
    e, two_ip, hp = w13.shape
    v = w13.reshape(e, two_ip // 32, 2, 16, hp)
    gate = v[:, :, 0].reshape(e, two_ip // 2, hp)[:, :i, :h]
    up = v[:, :, 1].reshape(e, two_ip // 2, hp)[:, :i, :h]
    return torch.cat([gate, up], dim=1)


def fp8_row_block_scales(scale: torch.Tensor, rows: int, rows_pad: int, k_pad: int, block: tuple[int, int]):
    """Checkpoint block scales [E, ceil(rows/bn), ceil(K/bk)] -> [E, rows_pad/16, k_pad/bk] f32: the scale
    of each 16-row block (bn % 16 == 0: one checkpoint block row) and K group; padding gets 0."""
    bn, bk = block
    e, nb, kb = scale.shape
    out = torch.zeros(e, rows_pad // 16, k_pad // bk, dtype=torch.float32, device=scale.device)
    nr = -(-rows // 16)
    out[:, :nr, :kb] = scale.float()[:, torch.arange(nr, device=scale.device) * 16 // bn]
    return out


def _check_fp8_finite(u: torch.Tensor, what: str) -> None:
    """The kernels widen e4m3 without a NaN case (S.1111.111 would read as 480): refuse NaN weights."""
    if bool(((u & 0x7F) == E4M3_NAN_BITS).any()):
        raise ValueError(f"fp8 {what} weights hold NaN")


@dataclass
class PackedMatrix:
    """One stacked matrix [E, N, K] in kernel layout (N, K padded)."""

    data: torch.Tensor  # uint8 [E, bytes]
    n: int
    k: int
    scale: torch.Tensor | None = None  # int8 [E, N] | int4 d [E, N/16, K/G, 16] | fp8 [E, N/16, K/G]
    zero: torch.Tensor | None = None  # int4 asymmetric m
    wsum: torch.Tensor | None = None  # int8 [E, N] int32 row sums


@dataclass
class PackedLayer:
    method: str
    num_experts: int
    hidden: int
    inter: int
    hidden_pad: int
    inter_pad: int
    group_size: int
    symmetric: bool
    activation: str
    w13: PackedMatrix
    w2: PackedMatrix
    extra: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict (for writing to disk)."""
        out = {}
        for name, m in (("w13", self.w13), ("w2", self.w2)):
            for part in ("data", "scale", "zero", "wsum"):
                t = getattr(m, part)
                if t is not None:
                    out[f"{name}.{part}"] = t
        return out

    def meta(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "method",
                "num_experts",
                "hidden",
                "inter",
                "hidden_pad",
                "inter_pad",
                "group_size",
                "symmetric",
                "activation",
            )
        }

    @classmethod
    def from_tensors(cls, meta: dict, tensors: dict[str, torch.Tensor]) -> PackedLayer:
        hp, ip = meta["hidden_pad"], meta["inter_pad"]
        mats = {}
        for name, n, k in (("w13", 2 * ip, hp), ("w2", hp, ip)):
            mats[name] = PackedMatrix(
                tensors[f"{name}.data"], n, k, *(tensors.get(f"{name}.{p}") for p in ("scale", "zero", "wsum"))
            )
        return cls(**meta, w13=mats["w13"], w2=mats["w2"])

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the kernels effectively use, fp32: gate_up [E, 2I, H], down [E, H, I]."""
        w13 = dequantize_matrix(self.w13, self.method, self.group_size)
        w2 = dequantize_matrix(self.w2, self.method, self.group_size)
        return deinterleave_w13(w13, self.inter, self.hidden), w2[:, : self.hidden, : self.inter].contiguous()


def pad_sizes(hidden: int, inter: int, method: str, group_size: int) -> tuple[int, int]:
    m = method.upper()
    mult = max(64, group_size) if m == "AMXINT4" else math.lcm(64, group_size) if m == "FP8" else 64
    return -(-hidden // mult) * mult, -(-inter // mult) * mult


def pack_matrix(w: torch.Tensor, method: str, group_size: int = 128, symmetric: bool = True) -> PackedMatrix:
    """[E, N, K] (already padded: N % 64 == 0, K % max(64, G) == 0) -> PackedMatrix."""
    _, n, k = w.shape
    method = method.upper()
    if method == "AMXINT8":
        q, s = quantize_int8(w)
        return PackedMatrix(pack_blocks(q, 1), n, k, scale=s.contiguous(), wsum=q.sum(dim=-1, dtype=torch.int32))
    if method == "AMXINT4":
        u, d, m = quantize_int4(w, group_size, symmetric)
        zero = None if symmetric else pack_group_params(m)
        return PackedMatrix(pack_int4_blocks(u), n, k, scale=pack_group_params(d), zero=zero)
    if method == "BF16":
        return PackedMatrix(pack_blocks(w.to(torch.bfloat16), 2), n, k)
    if method == "FP8":
        raise ValueError("FP8 matrices are packed per layer (pack_layer / pack_fp8_matrices): gate and up are "
                         "blocked separately")
    raise ValueError(f"unknown method {method!r}")


def dequantize_matrix(p: PackedMatrix, method: str, group_size: int) -> torch.Tensor:
    method = method.upper()
    if method == "AMXINT8":
        return dequantize_int8(unpack_blocks(p.data, p.n, p.k, torch.int8), p.scale)
    if method == "AMXINT4":
        u = unpack_int4_blocks(p.data, p.n, p.k)
        d = unpack_group_params(p.scale, p.n)
        m = unpack_group_params(p.zero, p.n) if p.zero is not None else -8.0 * d
        return dequantize_int4(u, d, m, group_size)
    if method == "FP8":
        w = unpack_pairs(p.data, p.n, p.k).view(FP8_DTYPE).float()
        e, nb, ng = p.scale.shape
        return (w.view(e, nb, 16, ng, p.k // ng) * p.scale.view(e, nb, 1, ng, 1)).view(e, p.n, p.k)
    return unpack_blocks(p.data, p.n, p.k, torch.bfloat16).float()


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, page: int = 4096) -> torch.Tensor:
    """An uninitialised CPU tensor that owns whole pages (see page_aligned)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    padded = -(-max(nbytes, 1) // page) * page
    raw = torch.empty(padded + page, dtype=torch.uint8)
    off = (-raw.data_ptr()) % page
    return raw[off : off + nbytes].view(dtype).view(shape)


def owns_pages(t: torch.Tensor, page: int = 4096) -> bool:
    """Whether t starts on a page and the rest of its last page lies in its own storage."""
    if t.nbytes == 0:
        return True
    st = t.untyped_storage()
    end = t.data_ptr() + -(-t.nbytes // page) * page
    return t.data_ptr() % page == 0 and st.data_ptr() <= t.data_ptr() and end <= st.data_ptr() + st.nbytes()


def page_aligned(t: torch.Tensor, page: int = 4096) -> torch.Tensor:
    """A copy of CPU tensor t that owns whole pages: it starts on a page boundary and the rest of
    its last page belongs to the same allocation. Page-locking such a tensor in place
    (cuMemHostRegister) cannot take a neighbour's memory with it: a range the driver sees as only
    partly locked makes every DMA copy from it fail with "invalid argument"."""
    if owns_pages(t, page):
        return t  # already (also: nothing to lock)
    out = page_aligned_empty(tuple(t.shape), t.dtype, page)
    out.copy_(t)
    return out


def page_aligned_layer(p: PackedLayer) -> PackedLayer:
    """The same packed layer with every tensor in pages of its own (see page_aligned)."""

    def m(x: PackedMatrix) -> PackedMatrix:
        def a(t):
            return None if t is None else page_aligned(t.contiguous())

        return PackedMatrix(a(x.data), x.n, x.k, a(x.scale), a(x.zero), a(x.wsum))

    return PackedLayer(p.method, p.num_experts, p.hidden, p.inter, p.hidden_pad, p.inter_pad, p.group_size,
                       p.symmetric, p.activation, m(p.w13), m(p.w2))


def _fp8_split(gate_up: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    """(gate, gate scales), (up, up scales) of a fp8 gate_up [E, 2I, H] (gate's scale rows first)."""
    i = gate_up.shape[1] // 2
    nbi = -(-i // block[0])
    return (gate_up[:, :i], scale[:, :nbi]), (gate_up[:, i:], scale[:, nbi:])


def _dequant_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], device) -> torch.Tensor:
    """fp8 [c, N, K] + block scales -> float32 [c, N, K] on device (one expert's matrix at a time)."""
    out = torch.empty(w.shape, dtype=torch.float32, device=device)
    for x in range(w.shape[0]):
        block_dequant(w[x].to(device), scale[x].to(device), block, out=out[x])
    return out


def _quant_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [c, N, K] -> fp8 [c, N, K] and block scales [c, ceil(N/bn), ceil(K/bk)] (weights/fp8.block_quant)."""
    parts = [block_quant(w[x], block) for x in range(w.shape[0])]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def pack_fp8_matrices(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor, down_scale: torch.Tensor,
                      block: tuple[int, int], ip: int, hp: int) -> tuple[PackedMatrix, PackedMatrix]:
    """fp8 experts (ExpertWeights' block-scaled form) -> the FP8 method's w13 / w2, bytes kept as they are."""
    e, two_i, h = gate_up.shape
    i = two_i // 2
    bn, bk = block
    nbi, nbh = -(-i // bn), -(-h // bn)
    want = {"gate_up_scale": (e, 2 * nbi, -(-h // bk)), "down_scale": (e, nbh, -(-i // bk))}
    for name, t in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want[name]} for {bn}x{bk} blocks")
    if gate_up.dtype != FP8_DTYPE or down.dtype != FP8_DTYPE:
        raise ValueError(f"--kt-method FP8 takes float8_e4m3fn weights, got {gate_up.dtype} / {down.dtype}")
    gu, dn = gate_up.cpu().view(torch.uint8), down.cpu().view(torch.uint8)
    _check_fp8_finite(gu, "gate_up")
    _check_fp8_finite(dn, "down")
    for name, t in (("gate_up", gate_up_scale), ("down", down_scale)):  # a NaN scale: NaN for its whole block
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"fp8 {name} block scales (weight_scale_inv) hold NaN or infinite values")
    (_, sg), (_, su) = _fp8_split(gate_up, gate_up_scale.cpu(), block)
    s13 = torch.stack([fp8_row_block_scales(sg, i, ip, hp, block), fp8_row_block_scales(su, i, ip, hp, block)], dim=2)
    w13 = PackedMatrix(pack_pairs(interleave_w13(gu, ip, hp)), 2 * ip, hp,
                       scale=s13.reshape(e, 2 * ip // 16, hp // bk).contiguous())
    w2 = PackedMatrix(pack_pairs(_pad2(dn, hp, ip)), hp, ip,
                      scale=fp8_row_block_scales(down_scale.cpu(), h, hp, ip, block).contiguous())
    return w13, w2


def pack_layer(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    method: str = "AMXINT8",
    group_size: int = 128,
    symmetric: bool = True,
    activation: str = "silu",
    chunk: int = 8,
    device: torch.device | str | None = None,
    page_align: bool = False,
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> PackedLayer:
    """Quantizes and packs one layer's experts (gate_up [E, 2I, H], down [E, H, I]); `chunk` experts at a
    time to bound the fp32 temporaries. `device`: where the packing arithmetic runs (default the CPU;
    a GPU packs random benchmark weights far faster); the result is always in host memory, in
    tensors that own their pages with `page_align` (see page_aligned).

    Block-scaled fp8 weights (float8_e4m3fn with `fp8_scales` = (gate_up_scale, down_scale) and
    `fp8_block` = (bn, bk), as in ExpertWeights): method FP8 keeps their bytes (group size = bk); any
    other method dequantizes `chunk` experts at a time and quantizes those. Float weights with method
    FP8 are block-quantized first, in group_size x group_size blocks (tests, benchmarks)."""
    method = method.upper()
    method_code(method)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; available: {sorted(ACTIVATIONS)}")
    e, two_i, h = gate_up.shape
    i = two_i // 2
    if down.shape != (e, h, i):
        raise ValueError(f"down has shape {tuple(down.shape)}, expected {(e, h, i)}")
    fp8_in = gate_up.dtype in FP8_DTYPES
    if fp8_in and (fp8_scales is None or fp8_block is None):
        raise ValueError("fp8 expert weights need their block scales (fp8_scales) and block size (fp8_block)")
    if method == "FP8":
        fp8_block = check_fp8_block(fp8_block if fp8_in else (group_size, group_size))
        group_size = fp8_block[1]
    hp, ip = pad_sizes(h, i, method, group_size)
    alloc = page_aligned_empty if page_align else None
    w13, w2 = PackedAssembly(e, alloc), PackedAssembly(e, alloc)  # chunks copied in: no second host copy
    for e0 in range(0, e, chunk):
        sl = slice(e0, e0 + chunk)
        if method == "FP8":
            if fp8_in:
                parts = (gate_up[sl], down[sl], fp8_scales[0][sl], fp8_scales[1][sl])
            else:
                gu = gate_up[sl].detach().to(device or "cpu", torch.float32)
                dn = down[sl].detach().to(device or "cpu", torch.float32)
                (qg, sg), (qu, su) = _quant_fp8(gu[:, :i], fp8_block), _quant_fp8(gu[:, i:], fp8_block)
                qd, sd = _quant_fp8(dn, fp8_block)
                parts = (torch.cat([qg, qu], 1), qd, torch.cat([sg, su], 1), sd)
            a, b = pack_fp8_matrices(*parts, fp8_block, ip, hp)
            w13.add(a)
            w2.add(b)
            continue
        if fp8_in:  # dequantized a chunk at a time: never the whole layer in fp32
            (g8, sg), (u8, su) = _fp8_split(gate_up[sl], fp8_scales[0][sl], fp8_block)
            dev = device or "cpu"
            gu = torch.cat([_dequant_fp8(g8, sg, fp8_block, dev), _dequant_fp8(u8, su, fp8_block, dev)], dim=1)
            dn = _dequant_fp8(down[sl], fp8_scales[1][sl], fp8_block, dev)
        else:
            gu = gate_up[sl].detach().to(device or "cpu", torch.float32)
            dn = down[sl].detach().to(device or "cpu", torch.float32)
        w13.add(pack_matrix(interleave_w13(gu, ip, hp), method, group_size, symmetric))
        w2.add(pack_matrix(_pad2(dn, hp, ip), method, group_size, symmetric))
    return PackedLayer(method, e, h, i, hp, ip, group_size, symmetric, activation, w13.result(), w2.result())
