"""Plain softmax top-k routing on the CPU in one native call (csrc/route_cpu.cpp): what
layers/fused_ops.topk_softmax runs for CPU tensors, and what the one-call decoder layer
(cpu/layer_decode.py) runs between its router GEMV and its MoE task, so both route identically.

    w, ids = topk_softmax_cpu(logits, k, renormalize)   # [T, E] fp32/bf16 -> [T, K] fp32, [T, K] int32

The ids are torch.topk's on the softmax (the same CPU algorithm and comparator, run on the logits:
csrc/route_cpu.cpp says where a tie can differ); the weights within a few fp32 ulps of
fused_ops.topk_softmax_ref's.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import ctypes as C

import torch

from hybridmoe.cpu import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_declared = None


def _lib():
    global _declared
    lb = native.lib()
    if _declared is not lb:
        lb.hm_topk_softmax.restype = C.c_int
        lb.hm_topk_softmax.argtypes = [C.c_void_p, C.c_int32, C.c_int64, C.c_int64, C.c_int64, C.c_int32, C.c_int32,
                                       C.c_void_p, C.c_void_p]
        _declared = lb
    return lb


def supports(logits: torch.Tensor, k: int) -> bool:
    """Whether topk_softmax_cpu takes these logits (2-D fp32/bf16 CPU, unit stride along E, 1 <= k <= E)."""
    return (logits.device.type == "cpu" and logits.dtype in _DTYPES and logits.dim() == 2
            and 1 <= k <= logits.shape[1] and (logits.stride(1) == 1 or logits.shape[1] == 1))


def topk_softmax_cpu(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, K] float32 and expert ids [T, K] int32 of logits [T, E] (see `supports`)."""
    if not supports(logits, k):
        raise ValueError(f"topk_softmax_cpu: needs 2-D fp32/bf16 CPU logits with unit stride and 1 <= k <= E, got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}, k={k}")
    t, e = logits.shape
    w = torch.empty(t, k, dtype=torch.float32)
    ids = torch.empty(t, k, dtype=torch.int32)
    if t and _lib().hm_topk_softmax(logits.data_ptr(), _DTYPES[logits.dtype], t, e, logits.stride(0) if t > 1 else e,
                                    k, int(bool(renormalize)), w.data_ptr(), ids.data_ptr()):
        raise ValueError(f"hm_topk_softmax refused T={t}, E={e}, K={k}")
    return w, ids
