"""The routed-expert interface every MoE compute backend implements, and its registry (the
built-in backends are registered in moe/__init__.py).

Legend: T tokens, H hidden size, I expert intermediate size, E experts of the layer, K top-k.

A backend owns one layer's routed experts and computes, for each token t,
    out[t] = sum_j  w[t, j] * down_e(act(gate_e x[t]) * up_e x[t]),   e = ids[t, j]
over the token's K selected experts. Model files call only `MoEExperts.forward`; which backend
runs (pure torch, Triton, the CPU engine, the hybrid GPU+CPU split) is chosen by name through
`create_experts`, so new backends plug in without touching model code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridmoe.registry import Registry

if TYPE_CHECKING:
    from hybridmoe.moe.options import ExpertsOptions


@dataclass
class ExpertWeights:
    """One layer's routed experts, stacked. Gate rows come first in gate_up.

    Block-scaled fp8 (a DeepSeek-V3 checkpoint, weights/fp8.py): gate_up and down are
    float8_e4m3fn and the `*_scale` tensors hold each (bn x bk) block's scale_inv (w = fp8 * scale).
    gate_up_scale is gate's block scales then up's, each ceil(I/bn) rows: [E, 2*ceil(I/bn), ceil(H/bk)]
    (not ceil(2I/bn): gate and up are blocked separately in the checkpoint). A backend that does not
    compute in fp8 calls `dequantized(dtype)`.
    """

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    activation: str = "silu"  # "silu" (SwiGLU); room for "gelu" and clamped variants
    gate_up_scale: torch.Tensor | None = None  # fp8 only: [E, 2*ceil(I/bn), ceil(H/bk)] float32
    down_scale: torch.Tensor | None = None  # fp8 only: [E, ceil(H/bn), ceil(I/bk)] float32
    block: tuple[int, int] | None = None  # fp8 only: (bn, bk)

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_scale is not None

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """These weights in `dtype` (itself when not fp8); computed on the tensors' device."""
        if not self.is_fp8:
            return self
        from hybridmoe.weights.fp8 import block_dequant

        assert self.block is not None and self.down_scale is not None
        e, i = self.num_experts, self.intermediate_size
        nbi = -(-i // self.block[0])
        gate_up = torch.empty(self.gate_up.shape, dtype=dtype, device=self.gate_up.device)
        down = torch.empty(self.down.shape, dtype=dtype, device=self.down.device)
        for x in range(e):  # one expert at a time: the fp32 temporaries stay small
            gate_up[x, :i] = block_dequant(self.gate_up[x, :i], self.gate_up_scale[x, :nbi], self.block)
            gate_up[x, i:] = block_dequant(self.gate_up[x, i:], self.gate_up_scale[x, nbi:], self.block)
            down[x] = block_dequant(self.down[x], self.down_scale[x], self.block)
        return ExpertWeights(gate_up=gate_up, down=down, activation=self.activation)

    def select(self, rows: slice | torch.Tensor) -> ExpertWeights:
        """The experts `rows` (a slice: views, no copy; an index tensor: copies), scales included."""
        gu_s, d_s = self.gate_up_scale, self.down_scale
        return ExpertWeights(gate_up=self.gate_up[rows], down=self.down[rows], activation=self.activation,
                             gate_up_scale=None if gu_s is None else gu_s[rows],
                             down_scale=None if d_s is None else d_s[rows], block=self.block)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]


class MoEExperts(ABC):
    """Routed experts of one MoE layer."""

    name: str = ""

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int
        topk_weights: torch.Tensor,  # [T, K] float32
    ) -> torch.Tensor:  # [T, H], dtype of x
        """Weighted sum over each token's selected experts."""

    def forward_with(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int
        topk_weights: torch.Tensor,  # [T, K] float32
        extra: Callable[[], torch.Tensor],  # more GPU work of the layer: () -> [T, H] dtype of x
    ) -> torch.Tensor:  # [T, H]: forward(...) + extra()
        """forward plus `extra()` (the shared experts). A backend whose forward waits on other
        hardware (hybrid: the CPU's task) runs `extra` in that window; this default runs it after."""
        return self.forward(x, topk_ids, topk_weights) + extra()


# factory(weights, layer_idx, options) -> backend; options: the typed engine-level settings
# (moe/options.py ExpertsOptions).
ExpertsFactory = Callable[[ExpertWeights, int, "ExpertsOptions"], MoEExperts]
# name -> factory; the built-in backends are registered by the package (moe/__init__.py) and
# imported on first use, so this interface imports none of them.
EXPERTS_BACKENDS: Registry[ExpertsFactory] = Registry("MoE experts backend")


def register_experts_backend(name: str) -> Callable[[ExpertsFactory], ExpertsFactory]:
    """Decorator registering an experts factory under `name` (for backends defined outside the package)."""
    return EXPERTS_BACKENDS.decorator(name)


def available_experts_backends() -> list[str]:
    """The registered backends that import here (this imports each; Triton may be missing)."""
    return EXPERTS_BACKENDS.available()


def create_experts(name: str, weights: ExpertWeights, layer_idx: int,
                   options: ExpertsOptions | None = None) -> MoEExperts:
    """A new experts backend `name` for one layer (UnknownNameError / FactoryLoadError otherwise)."""
    if options is None:
        from hybridmoe.moe.options import ExpertsOptions

        options = ExpertsOptions()
    return EXPERTS_BACKENDS.get(name)(weights, layer_idx, options)
