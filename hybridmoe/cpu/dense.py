"""Dense BF16 linears on the CPU engine's pool (csrc/dense.h): y = x W^T (+ b) for decode-sized
inputs, with the weight as torch holds it (bf16 [N, K], never repacked or copied).

    y = dense_linear(x, lm_head.weight)                 # x [T, K] bf16 -> y [T, N] bf16
    y = dense_linear(x, w, b, out_dtype=torch.float32, isa="avx2")

Every weight byte is read once per call (rows split across the pool's threads, tokens in tiles of
4 on AVX-512 / 2 on AVX2 over cache-resident row blocks), fp32 accumulation, the result rounded to
bf16 like torch's. The call is a task of the pool, so it runs after earlier MoE tasks and never
beside them. `dense_linear_reference` is the plain torch definition the tests compare against.
"""

from __future__ import annotations

import ctypes as C
from dataclasses import dataclass

import torch

from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUMoEError

_DT = {torch.float32: 0, torch.bfloat16: 1}


class DenseTask(C.Structure):
    """HmDenseTask (csrc/dense.h)."""

    _fields_ = [("w", C.c_void_p), ("x", C.c_void_p), ("bias", C.c_void_p), ("out", C.c_void_p),
                ("T", C.c_int64), ("ldw", C.c_int64), ("ldx", C.c_int64), ("ldo", C.c_int64),
                ("N", C.c_int32), ("K", C.c_int32), ("out_dtype", C.c_int32), ("pad_", C.c_int32),
                ("q8", C.c_void_p), ("q8_scale", C.c_void_p), ("q8_wsum", C.c_void_p), ("q8_N", C.c_int32),
                ("q8_Kd", C.c_int32)]


_declared = None


def _lib():
    """The native library with the dense entry points declared (once; native.py stays untouched)."""
    global _declared
    lb = native.lib()
    if _declared is not lb:
        lb.hm_dense_isa.restype, lb.hm_dense_isa.argtypes = C.c_int, [C.c_int, C.c_char_p, C.c_int]
        lb.hm_dense.restype = C.c_int
        lb.hm_dense.argtypes = [C.c_void_p, C.POINTER(DenseTask), C.c_int, C.c_int64, C.c_char_p, C.c_int]
        _declared = lb
    return lb


def dense_isa(isa: str | None = None) -> str:
    """The ISA path a dense call runs for `isa` (None: $HYBRIDMOE_CPU_ISA, else the best): "amx"
    runs the AVX-512 kernels. Raises native.CpuIsaError when it cannot run here."""
    name = native.resolve_isa(isa)
    err = C.create_string_buffer(512)
    got = _lib().hm_dense_isa(native.ISAS[name], err, len(err))
    if got < 0:
        raise native.CpuIsaError(f"dense kernels on {name!r}: {err.value.decode()}")
    return native.ISA_NAMES[got]


def dense_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The definition: fp32 products and sums of the bf16 values, bias added in fp32, then cast."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, pool=None,
                 isa: str | None = None, spin_us: int = 0) -> torch.Tensor:
    """x [..., K] bf16, weight [N, K] bf16 (rows contiguous), bias [N] (fp32 is used as is, other
    dtypes are converted per call) -> [..., N] in out_dtype (default bf16; or fp32). `out` (contiguous,
    that shape and dtype) is written instead of a new tensor. pool: a CPUThreadPool (default: the
    process-wide one); spin_us: how long the caller spins for the result before it sleeps (-1: the pool's spin_us;
    0, the default: sleep at once, leaving the cores to the pool's threads)."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"dense_linear needs bf16 x and weight, got {x.dtype} and {weight.dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("dense_linear runs on CPU tensors")
    if weight.dim() != 2 or weight.stride(1) != 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[-1]}] with contiguous rows, got {tuple(weight.shape)}")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out_dtype = out_dtype or (out.dtype if out is not None else torch.bfloat16)
    if out_dtype not in _DT:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if out is None:
        out = torch.empty(*lead, n, dtype=out_dtype)
    elif out.shape != (*lead, n) or out.dtype != out_dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous CPU {out_dtype} tensor of shape {(*lead, n)}")
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        bias = bias.detach().to("cpu", torch.float32).contiguous()
    if pool is None:
        from hybridmoe.cpu.engine import default_pool

        pool = default_pool()
    if not pool.handle:
        raise RuntimeError("the CPU thread pool is closed")
    task = DenseTask(weight.data_ptr(), x2.data_ptr(), bias.data_ptr() if bias is not None else None,
                     out.data_ptr(), x2.shape[0], weight.stride(0), x2.stride(0), n, n, k, _DT[out_dtype], 0)
    err = C.create_string_buffer(512)
    if _lib().hm_dense(pool.handle, C.byref(task), native.ISAS[native.resolve_isa(isa)], int(spin_us), err,
                       len(err)):
        raise native.CpuIsaError(err.value.decode())
    return out


@dataclass(frozen=True)
class Int8Weight:
    """A [N, K] weight in the int8 experts' packed layout (csrc/common.h) for the dense kernels:
    symmetric per-row int8 (quant.quantize_int8's values), N and K padded to multiples of 64."""

    data: torch.Tensor   # uint8 [1, n_pad * k_pad]
    scale: torch.Tensor  # f32 [1, n_pad]
    wsum: torch.Tensor   # i32 [1, n_pad] row sums of the int8 values
    n: int
    k: int

    @property
    def n_pad(self) -> int:
        return self.scale.shape[1]

    @property
    def k_pad(self) -> int:
        return self.data.shape[1] // self.n_pad

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes + self.wsum.nbytes


def pack_int8(weight: torch.Tensor, pool=None) -> Int8Weight:
    """weight [N, K] (bf16/f16/f32, CPU) -> Int8Weight, quantized by the native packer on `pool`."""
    from hybridmoe.cpu import pack

    if weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_int8 takes a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    m = pack.empty_matrix(1, -(-n // 64) * 64, -(-k // 64) * 64, "AMXINT8", 128, True)
    pack.quantize_into(weight.detach()[None], m, "AMXINT8", 128, True, pool=pool)
    return Int8Weight(m.data, m.scale, m.wsum, n, k)


def dense_linear_int8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The definition of the int8 path: per-row int8 weights (quant.quantize_int8), per-token int8
    activations (quant.quantize_act_int8), exact integer dot products, times both scales in fp32."""
    from hybridmoe.cpu.quant import quantize_act_int8, quantize_int8

    qw, sw = quantize_int8(weight)
    x2 = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_act_int8(x2)
    acc = (qx.double() @ qw.double().t()).float()  # exact: |sums| < 2^53
    y = acc * sx[:, None] * sw[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype or x.dtype)


def dense_linear_int8(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None, *,
                      out_dtype: torch.dtype | None = None, pool=None, isa: str | None = None,
                      spin_us: int = 0) -> torch.Tensor:
    """dense_linear with int8 weights (pack_int8): x [..., K] bf16 with at most 16 rows -> [..., N]."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != w.k:
        raise ValueError(f"dense_linear_int8 needs bf16 CPU x [..., {w.k}], got {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, w.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in _DT:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    out = torch.empty(*x.shape[:-1], w.n, dtype=out_dtype)
    if bias is not None:
        if bias.shape != (w.n,):
            raise ValueError(f"bias must be [{w.n}], got {tuple(bias.shape)}")
        bias = bias.detach().to("cpu", torch.float32).contiguous()
    if pool is None:
        from hybridmoe.cpu.engine import default_pool

        pool = default_pool()
    task = DenseTask(None, x2.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                     x2.shape[0], 0, x2.stride(0), w.n, w.n, w.k, _DT[out_dtype], 0)
    set_int8(task, w)
    err = C.create_string_buffer(512)
    if _lib().hm_dense(pool.handle, C.byref(task), native.ISAS[native.resolve_isa(isa)], int(spin_us), err,
                       len(err)):
        raise CPUMoEError(err.value.decode())  # a RuntimeError; .token: the input row it names
    return out


def set_int8(task: DenseTask, w: Int8Weight | None) -> None:
    """Points `task` at int8 weights (None: back to its bf16 `w`)."""
    if w is None:
        task.q8 = task.q8_scale = task.q8_wsum = None
        task.q8_N = task.q8_Kd = 0
        return
    task.q8, task.q8_scale, task.q8_wsum = w.data.data_ptr(), w.scale.data_ptr(), w.wsum.data_ptr()
    task.q8_N, task.q8_Kd = w.n_pad, w.k_pad


NATIVE_ARGMAX = [True]  # benchmarks switch it off to time the torch path (bench_cpu_decode.py --dense off)


def argmax_rows(logits: torch.Tensor, nonfinite: int | None = None) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) for a 2-D CPU bf16 tensor with unit column stride, natively
    (greedy decode: torch's bf16 argmax over a 152k vocabulary took ~0.5 ms, 1% of a CPU-only step);
    the same answer (first maximum, NaN above all), or `nonfinite` for a row that holds NaN or +inf (the
    sampler's mark, found in the same pass). None when it does not apply here."""
    if not NATIVE_ARGMAX[0] or logits.dim() != 2 or logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.stride(1) != 1 \
            or logits.shape[1] < 1:
        return None
    lb = _lib()
    if not getattr(lb, "_hm_argmax_declared", False):
        lb.hm_argmax_bf16.restype = C.c_int
        lb.hm_argmax_bf16.argtypes = [C.c_void_p, C.c_int64, C.c_int64, C.c_int64, C.c_void_p, C.c_int32, C.c_int64]
        lb._hm_argmax_declared = True
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if lb.hm_argmax_bf16(logits.data_ptr(), logits.shape[1], logits.shape[0], logits.stride(0), out.data_ptr(),
                         int(nonfinite is not None), 0 if nonfinite is None else nonfinite):
        return None
    return out
