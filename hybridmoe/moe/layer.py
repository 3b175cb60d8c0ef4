"""The sparse MoE block of a decoder layer: router, routed experts (through the MoEExperts
interface), and optional shared experts: one dense MLP added to every token's output, scaled by a
sigmoid gate (Qwen2-MoE's `shared_expert` + `shared_expert_gate`) or not (DeepSeek's
`shared_experts`).

Legend: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe import envs
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.moe.experts import MoEExperts
from hybridmoe.moe.recorder import RecordingExperts
from hybridmoe.moe.routing import RoutingConfig, route


class FP32Router(nn.Module):
    """A router kept in float32 whatever the model dtype (DeepSeek: the checkpoint's reference
    computes the router logits in fp32, and the bias-corrected selection is sensitive to them).

    Parameters: weight [E, H] and, with `score_bias`, e_score_correction_bias [E] (checkpoint names)."""

    def __init__(self, hidden: int, num_experts: int, score_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if score_bias else None)

    def _apply(self, fn, recurse=True):  # model.to(dtype) casts every parameter: these stay float32
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] float32
        return F.linear(x.float(), self.weight)


class SparseMoEBlock(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        renormalize: bool,
        shared_intermediate: int = 0,
        gate_name: str = "gate",
        routing: RoutingConfig | None = None,
        shared_name: str = "shared_expert",
        shared_gated: bool = True,
        router_fp32: bool = False,
        score_bias: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts, self.top_k, self.intermediate = num_experts, top_k, intermediate
        self.renormalize = renormalize
        self.routing = routing or RoutingConfig(top_k=top_k, renormalize=renormalize)
        self.gate_name = gate_name
        if router_fp32 or score_bias:
            self.add_module(gate_name, FP32Router(hidden, num_experts, score_bias))
        else:
            self.add_module(gate_name, nn.Linear(hidden, num_experts, bias=False))
        self.score_bias = score_bias
        self.shared_name, self.shared_gated = shared_name, shared_gated
        if shared_intermediate > 0:
            self.add_module(shared_name, GatedMLP(hidden, shared_intermediate))
            if shared_gated:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.has_shared = shared_intermediate > 0
        self.experts: MoEExperts | None = None  # set by the loader once the weights are read
        self._ticket: torch.Tensor | None = None  # the fused router's counter (router_triton.new_ticket)

    def shared(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]: the shared experts' term
        out = getattr(self, self.shared_name)(x)
        if self.shared_gated:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        gate = getattr(self, self.gate_name)
        if self._fused_router(x, gate):  # one token on CUDA: the router GEMV and top-k in one launch
            from hybridmoe.moe.router_triton import new_ticket, router_topk

            if self._ticket is None or self._ticket.device != x.device:
                self._ticket = new_ticket(x.device)
            experts, counts, valid = self.experts, None, None
            if isinstance(experts, RecordingExperts):  # the router launch counts the experts, not a second one
                counts, valid = experts.recorder.count_target(experts.layer_idx, x.device)
                experts = experts.inner
            weights, ids, _ = router_topk(x, gate.weight, self.routing.top_k, self.routing.renormalize, self._ticket,
                                          counts=counts, valid_rows=valid)
            return self.forward_routed(x, ids, weights, experts)
        return self.forward_logits(x, gate(x))

    def _fused_router(self, x: torch.Tensor, gate: nn.Module) -> bool:
        """Whether this forward takes moe/router_triton.py (shapes, types and flags only: no sync). A router
        that is not a plain bias-free nn.Linear (LoRA-wrapped, fp32, on the CPU) keeps the two steps."""
        return (x.shape[0] == 1 and x.is_cuda and type(gate) is nn.Linear and gate.bias is None
                and self.routing.is_plain_softmax and not self.score_bias and x.dtype in (torch.bfloat16, torch.float16)
                and gate.weight.dtype == x.dtype and gate.weight.is_contiguous() and self.num_experts <= 4096
                and envs.router_fused())

    def forward_logits(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # [T, H], [T, E] -> [T, H]
        """The block after its router GEMV (a caller that computed the logits itself: cpu/layer_decode.py)."""
        gate = getattr(self, self.gate_name)
        bias = gate.e_score_correction_bias if self.score_bias else None
        weights, ids = route(logits, self.routing, bias)  # [T, K]
        return self.forward_routed(x, ids, weights)

    def forward_routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: MoEExperts | None = None) -> torch.Tensor:
        """The block after its routing: ids [T, K] int32, weights [T, K] float32 -> [T, H]. `experts`: the
        backend to run (default self.experts; the fused router passes the one inside the recorder's wrapper)."""
        experts = self.experts if experts is None else experts
        assert experts is not None, "expert weights were not loaded"
        if self.has_shared:  # a backend waiting on the CPU runs the shared experts in that window
            return experts.forward_with(x, ids, weights, lambda: self.shared(x))
        return experts.forward(x, ids, weights)
