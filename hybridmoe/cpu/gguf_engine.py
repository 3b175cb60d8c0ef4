"""One MoE layer's routed experts computed in their GGUF quantization (--kt-method LLAMAFILE).

Legend: T tokens, K top-k, E experts, H hidden, I intermediate, RB bytes per row.

    layer = GGUFMoELayer(GGUFExperts.of(gate, up, down, ("Q4_K", "Q4_K", "Q6_K")), pool=pool)
    y = layer.forward(x, ids, w)            # same submit / sync / forward as CPUMoELayer

The matrices stay as the file stores them (uint8 rows of GGUF blocks, typically memory-mapped
views from hybridmoe.gguf.reader: nothing is copied or requantized); the native kernels
(csrc/gguf_*.cpp) quantize activations per token (Q8_K-style); few rows per expert (decode) dot the
packed blocks directly (unpacked in registers, csrc/gguf_dot512.h / gguf_dot256.h), more rows unpack
each 16-row block once into a cache-resident tile (csrc/gguf_gemm.h).
"""

from __future__ import annotations

import ctypes as C
from dataclasses import dataclass

import torch

from hybridmoe import envs
from hybridmoe.cpu import gguf_quant, native
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool, default_pool
from hybridmoe.cpu.quant import ACTIVATIONS


@dataclass
class GGUFExperts:
    """gate, up [E, I, RB_h] and down [E, H, RB_i] uint8 rows of GGUF blocks, with their types."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    types: tuple[int, int, int]  # GGML type ids of gate, up, down
    hidden: int
    inter: int
    activation: str = "silu"
    method: str = "LLAMAFILE"

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @classmethod
    def of(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types, activation: str = "silu",
           name: str = "experts") -> GGUFExperts:
        """Checks the shapes against the types; `name` goes into the error messages."""
        tids = tuple(gguf_quant.type_id(t) for t in types)
        e, i = gate.shape[0], gate.shape[1]
        h = down.shape[1]
        for what, m, tid, (n, k) in (("gate", gate, tids[0], (i, h)), ("up", up, tids[1], (i, h)),
                                     ("down", down, tids[2], (h, i))):
            rb = gguf_quant.row_bytes(tid, k)
            if m.dtype != torch.uint8 or tuple(m.shape) != (e, n, rb):
                raise ValueError(f"{name} {what}: expected uint8 [{e}, {n}, {rb}] ({gguf_quant.TYPES[tid][0]} rows of "
                                 f"{k} values), got {m.dtype} {tuple(m.shape)}")
            if m.device.type != "cpu" or not m.is_contiguous():
                raise ValueError(f"{name} {what}: must be a contiguous CPU tensor")
        if h % 256 or i % 256:
            raise ValueError(f"{name}: the GGUF kernels need hidden and intermediate sizes that are multiples of 256, "
                             f"got H={h}, I={i}")
        return cls(gate, up, down, tids, h, i, activation)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"gate": self.gate, "up": self.up, "down": self.down}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) float32: what the kernels compute with."""
        g = gguf_quant.dequantize(self.gate, self.types[0])
        u = gguf_quant.dequantize(self.up, self.types[1])
        return torch.cat([g, u], dim=1), gguf_quant.dequantize(self.down, self.types[2])


def _mat(m: torch.Tensor, tid: int, k: int) -> native.GgufMat:
    e, n, rb = m.shape
    return native.GgufMat(m.data_ptr(), n * rb, rb, tid, n, k, 0)


class GGUFMoELayer(CPUMoELayer):
    """CPUMoELayer on GGUF blocks: the same task interface, a GGUF native layer underneath. AVX-512
    VNNI or AVX2 kernels (an explicit "amx" request, or HYBRIDMOE_CPU_ISA=amx, runs the AVX-512 ones with AMX tiles
    for large T; the best-ISA default on an AMX host takes the AVX-512 path; `kernel_name` says which)."""

    def __init__(self, experts: GGUFExperts, isa: str | None = None, pool: CPUThreadPool | None = None,
                 act_alpha: float = 1.702, act_limit: float = 7.0):
        self.packed = experts
        self.isa = native.resolve_isa(isa)
        if self.isa == "amx" and (isa or envs.cpu_isa()) is None:
            # the AMX tile path only when asked for: on the H100 host (session 25, bench_gguf_moe.py, Q4_K and
            # Q8_0, T = 1024 and 4096, two interleaved rounds) it ran at 0.80-1.05x the AVX-512 step path
            self.isa = "avx512"
        self.pool = pool or default_pool()
        x = experts
        self._desc = native.GgufDesc(x.num_experts, x.hidden, x.inter, ACTIVATIONS[x.activation], act_alpha, act_limit,
                                     _mat(x.gate, x.types[0], x.hidden), _mat(x.up, x.types[1], x.hidden),
                                     _mat(x.down, x.types[2], x.inter))
        err = C.create_string_buffer(512)
        h = native.lib().hm_gguf_layer_create(C.byref(self._desc), native.ISAS[self.isa], err, len(err))
        if not h:
            raise ValueError(f"cannot create the GGUF CPU MoE layer: {err.value.decode()}")
        self._h = h
        self.kernel_name = native.lib().hm_layer_kernel_name(h).decode()
        self.numa_unplaced = 0  # weights stay where the file's pages are (no per-node binding)

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:
            try:
                if self.pool.handle:
                    self.pool.sync(max_pending=0)
            except Exception:
                pass
            native.lib().hm_gguf_layer_destroy(h)
            self._h = None
