"""The routed-expert interface every MoE compute backend implements, and its registry.

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

import torch


@dataclass
class ExpertWeights:
    """One layer's routed experts, stacked. Gate rows come first in gate_up."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    activation: str = "silu"  # "silu" (SwiGLU); room for "gelu" and clamped variants

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


# factory(weights, layer_idx, options) -> backend; options are engine-level settings.
ExpertsFactory = Callable[[ExpertWeights, int, dict], MoEExperts]
_BACKENDS: dict[str, ExpertsFactory] = {}


def register_experts_backend(name: str) -> Callable[[ExpertsFactory], ExpertsFactory]:
    def wrap(factory: ExpertsFactory) -> ExpertsFactory:
        _BACKENDS[name] = factory
        return factory

    return wrap


def available_experts_backends() -> list[str]:
    _import_builtin()
    return sorted(_BACKENDS)


def create_experts(name: str, weights: ExpertWeights, layer_idx: int, options: dict | None = None) -> MoEExperts:
    _import_builtin()
    if name not in _BACKENDS:
        raise ValueError(f"unknown MoE experts backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name](weights, layer_idx, options or {})


def _import_builtin() -> None:
    from hybridmoe.moe import cpu_experts, hybrid, torch_experts  # noqa: F401

    try:  # Triton is optional (absent on some CPU-only installs)
        from hybridmoe.moe import triton_experts  # noqa: F401
    except ImportError:
        pass
