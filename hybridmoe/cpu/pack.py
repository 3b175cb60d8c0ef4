"""Load-time packing of routed experts through the native quantizers (csrc/quantize.cpp): the same
results as quant.pack_layer (the torch reference, bit for bit: tests/cpu/test_native_quant.py), on
all threads of a CPU pool, with no fp32 copy of the weights.

Legend: E experts, H hidden, I intermediate, N rows, K columns, "p" padded (quant.pad_sizes).

    packed = pack_layer(gate_up, down, "AMXINT8")          # native where it can, else quant.pack_layer
    packed = random_packed_layer(128, 2048, 768, "AMXINT8")  # random weights, drawn in packed form

The native path takes AMXINT8 / AMXINT4 / BF16 from f32, bf16 or f16 weights on the CPU (and from
block-scaled fp8 ones, dequantized a few experts at a time); everything else (FP8 method, packing on
a GPU) goes to quant.pack_layer.
"""

from __future__ import annotations

import ctypes as C
import re

import torch

from hybridmoe.cpu import hugepages, native, quant
from hybridmoe.cpu.engine import CPUThreadPool, default_pool
from hybridmoe.cpu.quant import ACTIVATIONS, PackedLayer, PackedMatrix, owns_pages, pad_sizes, page_aligned_empty
from hybridmoe.cpu.topology import physical_cores

NATIVE_METHODS = ("AMXINT8", "AMXINT4", "BF16")
_SRC_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def load_pool() -> CPUThreadPool:
    """The pool to quantize on: the process-wide one (created with every physical core when it does
    not exist yet: `hybridmoe convert` has nothing else to run)."""
    return default_pool(threads=len(physical_cores()))


def empty_matrix(e: int, n: int, k: int, method: str, group_size: int, symmetric: bool,
                 page_align: bool = False) -> PackedMatrix:
    """Uninitialised packed tensors of an [E, N, K] matrix (N, K padded), as pack_matrix makes them."""
    def new(shape, dtype):
        t = hugepages.empty(shape, dtype)  # big ones on huge pages (they own theirs: page-lockable in place)
        return page_aligned_empty(shape, dtype) if page_align and not owns_pages(t) else t

    if method == "AMXINT8":
        return PackedMatrix(new((e, n * k), torch.uint8), n, k, scale=new((e, n), torch.float32),
                            wsum=new((e, n), torch.int32))
    if method == "AMXINT4":
        gshape = (e, n // 16, k // group_size, 16)
        return PackedMatrix(new((e, n * k // 2), torch.uint8), n, k, scale=new(gshape, torch.float32),
                            zero=None if symmetric else new(gshape, torch.float32))
    if method == "BF16":
        return PackedMatrix(new((e, n * k * 2), torch.uint8), n, k)
    raise ValueError(f"no native packing for method {method!r}")


def _ptr(t: torch.Tensor | None, e0: int = 0) -> int | None:
    return None if t is None else t[e0:].data_ptr() if t.shape[0] else t.data_ptr()


def quantize_into(src: torch.Tensor | None, out: PackedMatrix, method: str, group_size: int, symmetric: bool,
                  e0: int = 0, experts: int | None = None, w13_inter: int = 0, source_shape: tuple[int, int] = (0, 0),
                  seed: int = 0, std: float = 0.02, pool: CPUThreadPool | None = None) -> None:
    """Packs src [e, N, K] (f32/bf16/f16 on the CPU, unit stride along K) into experts e0.. of `out`;
    gate_up [e, 2I, H] interleaved as w13 with w13_inter = I. src None: `experts` experts of random
    values (uniform, standard deviation `std`) of source_shape (N, K), drawn in place."""
    if src is not None:
        if src.device.type != "cpu" or src.dtype not in _SRC_DTYPES:
            raise ValueError(f"native packing takes f32/bf16/f16 CPU weights, got {src.dtype} on {src.device}")
        if src.stride(-1) != 1:
            src = src.contiguous()
        e, n, k = src.shape
        s = native.QuantSrc(src.data_ptr() if src.numel() else None, _SRC_DTYPES[src.dtype], e, n, k,
                            src.stride(0), src.stride(1), w13_inter, 0, 0, 0.0)
    else:
        e, (n, k) = int(experts or 0), source_shape
        s = native.QuantSrc(None, 0, e, n, k, 0, 0, w13_inter, 0, seed & (2**64 - 1), float(std))
    if e == 0:
        return
    if e0 + e > out.data.shape[0]:
        raise ValueError(f"experts {e0}..{e0 + e} past the {out.data.shape[0]} of the packed matrix")
    d = native.QuantDst(_ptr(out.data, e0), _ptr(out.scale, e0), _ptr(out.zero, e0), _ptr(out.wsum, e0), out.n, out.k,
                        quant.METHODS[method], group_size, int(symmetric), 0)
    pool = pool or load_pool()
    err = C.create_string_buffer(512)
    if native.lib().hm_quantize(pool.handle, C.byref(s), C.byref(d), err, len(err)):
        msg = err.value.decode()
        m = _NON_FINITE.match(msg)
        if m is None:
            raise ValueError(msg)
        ex, row = e0 + int(m.group(1)), int(m.group(2))  # the source's expert and row (w13: [gate; up])
        proj = "down_proj" if not w13_inter else "gate_proj" if row < w13_inter else "up_proj"
        row = row - w13_inter if proj == "up_proj" else row
        raise NonFiniteWeights(f"expert {ex} {proj} row {row}{m.group(3)}", ex, proj, row)


class NonFiniteWeights(ValueError):
    """Source weights with a NaN or an infinity (a damaged checkpoint): the expert (index in the layer),
    its projection (gate_proj, up_proj, down_proj) and row."""

    def __init__(self, message: str, expert: int, proj: str, row: int) -> None:
        super().__init__(message)
        self.expert, self.proj, self.row = expert, proj, row


_NON_FINITE = re.compile(r"expert (\d+) row (\d+)(: NaN or infinite values.*)$")  # csrc/quantize.cpp quantize_run


def native_supported(method: str, gate_up: torch.Tensor, device) -> bool:
    """Whether pack_layer takes the native path for these arguments."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    ok_dtype = gate_up.dtype in _SRC_DTYPES or gate_up.dtype in quant.FP8_DTYPES
    if not (method.upper() in NATIVE_METHODS and on_cpu and gate_up.device.type == "cpu" and ok_dtype):
        return False
    try:
        return native.isa_missing("avx2") == ""
    except Exception:  # no compiler / library: the torch reference packs
        return False


def pack_layer(gate_up: torch.Tensor, down: torch.Tensor, method: str = "AMXINT8", group_size: int = 128,
               symmetric: bool = True, activation: str = "silu", chunk: int = 8, device=None,
               page_align: bool = False, fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
               fp8_block: tuple[int, int] | None = None, pool: CPUThreadPool | None = None) -> PackedLayer:
    """quant.pack_layer's contract and result (gate_up [E, 2I, H], down [E, H, I]), packed natively
    where native_supported (see the module docstring); `chunk` only bounds fp8 dequantization."""
    method = method.upper()
    if not native_supported(method, gate_up, device):
        return quant.pack_layer(gate_up, down, method, group_size, symmetric, activation, chunk, device, page_align,
                                fp8_scales, fp8_block)
    if method == "AMXINT4" and group_size not in quant.GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {quant.GROUP_SIZES}, got {group_size}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; available: {sorted(ACTIVATIONS)}")
    e, two_i, h = gate_up.shape
    i = two_i // 2
    if down.shape != (e, h, i):
        raise ValueError(f"down has shape {tuple(down.shape)}, expected {(e, h, i)}")
    fp8_in = gate_up.dtype in quant.FP8_DTYPES
    if fp8_in and (fp8_scales is None or fp8_block is None):
        raise ValueError("fp8 expert weights need their block scales (fp8_scales) and block size (fp8_block)")
    hp, ip = pad_sizes(h, i, method, group_size)
    w13 = empty_matrix(e, 2 * ip, hp, method, group_size, symmetric, page_align)
    w2 = empty_matrix(e, hp, ip, method, group_size, symmetric, page_align)
    pool = pool or load_pool()
    if not fp8_in:
        quantize_into(gate_up.detach(), w13, method, group_size, symmetric, w13_inter=i, pool=pool)
        quantize_into(down.detach(), w2, method, group_size, symmetric, pool=pool)
    else:  # dequantized a chunk of experts at a time: never the whole layer in fp32
        for e0 in range(0, e, chunk):
            sl = slice(e0, e0 + chunk)
            (g8, sg), (u8, su) = quant._fp8_split(gate_up[sl], fp8_scales[0][sl], fp8_block)
            gu = torch.cat([quant._dequant_fp8(g8, sg, fp8_block, "cpu"), quant._dequant_fp8(u8, su, fp8_block, "cpu")],
                           dim=1)
            quantize_into(gu, w13, method, group_size, symmetric, e0=e0, w13_inter=i, pool=pool)
            dn = quant._dequant_fp8(down[sl], fp8_scales[1][sl], fp8_block, "cpu")
            quantize_into(dn, w2, method, group_size, symmetric, e0=e0, pool=pool)
    return PackedLayer(method, e, h, i, hp, ip, group_size, symmetric, activation, w13, w2)


def random_packed_layer(e: int, h: int, i: int, method: str = "AMXINT8", group_size: int = 128,
                        symmetric: bool = True, activation: str = "silu", std: float = 0.02, seed: int = 0,
                        page_align: bool = False, pool: CPUThreadPool | None = None) -> PackedLayer:
    """A layer of random experts (weights uniform with standard deviation `std`, quantized) drawn
    directly in packed form: no float copy of the layer is ever made (`--load-format dummy`)."""
    method = method.upper()
    if method not in NATIVE_METHODS:
        raise ValueError(f"random packed weights exist for {NATIVE_METHODS}, not {method!r}")
    hp, ip = pad_sizes(h, i, method, group_size)
    w13 = empty_matrix(e, 2 * ip, hp, method, group_size, symmetric, page_align)
    w2 = empty_matrix(e, hp, ip, method, group_size, symmetric, page_align)
    quantize_into(None, w13, method, group_size, symmetric, experts=e, w13_inter=i, source_shape=(2 * i, h),
                  seed=2 * seed, std=std, pool=pool)
    quantize_into(None, w2, method, group_size, symmetric, experts=e, source_shape=(h, i), seed=2 * seed + 1, std=std,
                  pool=pool)
    return PackedLayer(method, e, h, i, hp, ip, group_size, symmetric, activation, w13, w2)
