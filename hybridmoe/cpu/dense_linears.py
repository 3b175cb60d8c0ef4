"""The CPU-only model path's bf16 linears on the native dense kernels (hybridmoe.cpu.dense).

With every expert on the CPU engine and no GPU (`device="cpu"`, `--kt-num-gpu-experts 0`), the
attention projections, routers, dense MLPs and the LM head are the other half of the bytes a
decode token reads. torch's bf16 GEMV streams them at about half the engine pool's read bandwidth
(and its OpenMP threads and the pool take turns on the same cores); on the pool, every weight byte
is read once at the pool's bandwidth, with no second set of threads. Prefill-sized inputs
(> max_tokens rows) stay with torch's GEMM (oneDNN, AMX), which reuses each weight across many
rows far better; so do matrices under min_bytes (a pool round trip costs more than they do).

    dl = install_dense_linears(model, pool)   # None when nothing qualifies
    dl.enabled = False                        # back to torch (benchmarks compare both)

Results: fp32 sums of the same bf16 products, rounded to bf16 like torch's (only the summation
order differs: within bf16 rounding of torch, tests/cpu/test_dense.py).
"""

from __future__ import annotations

import ctypes as C

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.cpu import native
from hybridmoe.cpu.dense import DenseTask, Int8Weight, _lib, dense_isa, pack_int8, set_int8
from hybridmoe.cpu.engine import CPUMoEError

MAX_TOKENS = 4  # rows of x above which torch's GEMM is faster (benchmarks/bench_cpu_dense.py)
MIN_BYTES = 0  # every size: small weights are read by the calling thread itself (csrc/dense_api.cpp)


class DenseLinears:
    """Native forwards installed on a model's qualifying nn.Linear modules (see the module docstring)."""

    def __init__(self, model: nn.Module, pool, isa: str | None = None, max_tokens: int = MAX_TOKENS,
                 min_bytes: int = MIN_BYTES, int8: bool = False) -> None:
        self.pool, self.max_tokens = pool, max_tokens
        self.isa_code = native.ISAS[dense_isa(isa)]
        self.enabled = True
        self.spin_us = 0  # the caller sleeps at once: spinning, it would take a core from the pool's threads
        self.modules: dict[str, nn.Linear] = {}
        # int8: decode reads per-row int8 copies (dense.pack_int8) of every linear but the MoE routers
        # (their logits pick the experts; 0.5 MB a layer); prefill keeps torch's GEMM on the bf16 weights
        self.int8: dict[int, Int8Weight] = {}
        self.int8_enabled = True  # False: the bf16 weights again (benchmarks compare both in one process)
        routers = {id(getattr(b, b.gate_name)) for b in getattr(model, "moe_blocks", list)()
                   if isinstance(getattr(b, "gate_name", None), str)}
        for name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if (isinstance(mod, nn.Linear) and w is not None and w.dtype == torch.bfloat16 and w.device.type == "cpu"
                    and w.dim() == 2 and w.stride(1) == 1 and w.nbytes >= min_bytes):
                self.modules[name] = mod
                if int8 and id(mod) not in routers:
                    self.int8[id(mod)] = pack_int8(w.data, pool=pool)
                mod.forward = self._make_forward(mod)  # an instance attribute: nn.Linear.forward stays

    def int8_of(self, mod: nn.Module) -> Int8Weight | None:
        """The int8 copy a decode call of `mod` reads (None: its bf16 weight)."""
        return self.int8.get(id(mod)) if self.int8_enabled else None

    def remove(self) -> None:
        """Puts torch's forward back on every module."""
        for mod in self.modules.values():
            del mod.forward
        self.modules = {}

    def _make_forward(self, mod: nn.Linear):
        n, k = mod.weight.shape
        task = DenseTask(None, None, None, None, 0, 0, 0, n, n, k, 1, 0)
        q8 = self.int8.get(id(mod))
        set_int8(task, q8)
        int8_on = [q8 is not None]  # what the task points at (set_int8 again only when int8_enabled flips)
        err = C.create_string_buffer(512)
        bias32: list = [None, None]  # (key of the bias it was made from, fp32 copy)
        lb = _lib()

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // k if x.shape[-1] == k else -1
            if (not self.enabled or not self.pool.handle or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not 0 < rows <= self.max_tokens
                    or (x.requires_grad and torch.is_grad_enabled())):
                return F.linear(x, mod.weight, mod.bias)
            w = mod.weight
            x2 = x.reshape(rows, k)
            if x2.stride(1) != 1:
                x2 = x2.contiguous()
            out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
            b = mod.bias
            if b is not None:
                key = (b.data_ptr(), b._version)
                if bias32[0] != key:
                    bias32[0], bias32[1] = key, b.detach().float().contiguous()
                task.bias = bias32[1].data_ptr()
            task.w, task.ldw = w.data_ptr(), w.stride(0)
            if q8 is not None and int8_on[0] != self.int8_enabled:
                set_int8(task, q8 if self.int8_enabled else None)
                int8_on[0] = self.int8_enabled
            task.x, task.ldx, task.T, task.out = x2.data_ptr(), x2.stride(0), rows, out.data_ptr()
            if lb.hm_dense(self.pool.handle, C.byref(task), self.isa_code, self.spin_us, err, len(err)):
                raise CPUMoEError(err.value.decode())  # a RuntimeError; .token: the input row it names
            return out

        return forward


def install_dense_linears(model: nn.Module, pool, isa: str | None = None, **kw) -> DenseLinears | None:
    """DenseLinears on `model` with `pool` (the CPU expert engine's), or None when no module
    qualifies or the dense kernels cannot run here."""
    try:
        dl = DenseLinears(model, pool, isa, **kw)
    except native.CpuIsaError:
        return None
    return dl if dl.modules else None
