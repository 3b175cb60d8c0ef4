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

import torch

from hybridmoe.cpu import native

_DT = {torch.float32: 0, torch.bfloat16: 1}


class DenseTask(C.Structure):
    """HmDenseTask (csrc/dense.h)."""

    _fields_ = [("w", C.c_void_p), ("x", C.c_void_p), ("bias", C.c_void_p), ("out", C.c_void_p),
                ("T", C.c_int64), ("ldw", C.c_int64), ("ldx", C.c_int64), ("ldo", C.c_int64),
                ("N", C.c_int32), ("K", C.c_int32), ("out_dtype", C.c_int32), ("pad_", C.c_int32)]


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


NATIVE_ARGMAX = [True]  # benchmarks switch it off to time the torch path (bench_cpu_decode.py --dense off)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) for a 2-D CPU bf16 tensor with unit column stride, natively
    (greedy decode: torch's bf16 argmax over a 152k vocabulary took ~0.5 ms, 1% of a CPU-only step);
    the same answer (first maximum, NaN above all). None when it does not apply here."""
    if not NATIVE_ARGMAX[0] or logits.dim() != 2 or logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.stride(1) != 1 \
            or logits.shape[1] < 1:
        return None
    lb = _lib()
    if not getattr(lb, "_hm_argmax_declared", False):
        lb.hm_argmax_bf16.restype = C.c_int
        lb.hm_argmax_bf16.argtypes = [C.c_void_p, C.c_int64, C.c_int64, C.c_int64, C.c_void_p]
        lb._hm_argmax_declared = True
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if lb.hm_argmax_bf16(logits.data_ptr(), logits.shape[1], logits.shape[0], logits.stride(0), out.data_ptr()):
        return None
    return out
