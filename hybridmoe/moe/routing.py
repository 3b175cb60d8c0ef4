"""Router variants beyond plain softmax top-k: DeepSeek's grouped and bias-corrected selection.

Legend: T tokens, E routed experts, K experts per token, G expert groups (E/G experts each).

Methods (`RoutingConfig.method`):
- "greedy": top-k of the scores (softmax or sigmoid of the logits).
- "group_limited_greedy" (DeepSeek-V2): a group's score is its best expert's; only the experts of
  the topk_group best groups compete for the top-k.
- "noaux_tc" (DeepSeek-V3, Kimi-K2): sigmoid scores; the selection uses scores plus the
  per-expert e_score_correction_bias (load balancing without an auxiliary loss), a group's score
  is the sum of its two best biased scores; the weights are the unbiased scores of the chosen experts.
Then optionally renormalized to sum 1 (norm_topk_prob) and multiplied by routed_scaling_factor.

Device ops only (no host synchronization): capturable in a CUDA graph. The experts' order within
a token's K is unspecified (the MoE sum does not depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.layers.fused_ops import topk_softmax, use_triton

METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring: str = "softmax"
    method: str = "greedy"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"routing method {self.method!r} is not supported (supported: {', '.join(METHODS)})")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring function {self.scoring!r} is not supported (supported: {', '.join(SCORINGS)})")

    @property
    def is_plain_softmax(self) -> bool:
        """Softmax top-k with no groups or scaling: the fused kernel of layers/fused_ops.py."""
        return self.method == "greedy" and self.scoring == "softmax" and self.scaling == 1.0


def _group_mask(group_scores: torch.Tensor, topk_group: int, per_group: int) -> torch.Tensor:
    """[T, G] scores -> [T, E] bool: the experts of each token's topk_group best groups."""
    idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)  # [T, G]
    t, g = keep.shape
    return keep[:, :, None].expand(t, g, per_group).reshape(t, g * per_group)  # [T, E]


def route(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype; computed on in float32), bias [E] (noaux_tc) ->
    weights [T, K] float32, expert ids [T, K] int32."""
    if cfg.is_plain_softmax and bias is None:
        return topk_softmax(logits, cfg.top_k, cfg.renormalize)
    t, e = logits.shape
    if t and e <= 4096 and use_triton(logits):  # one kernel instead of ~20 (routing_triton's docstring)
        from hybridmoe.moe.routing_triton import grouped_topk

        return grouped_topk(logits if logits.stride(1) == 1 else logits.contiguous(), top_k=cfg.top_k,
                            scoring=cfg.scoring, method=cfg.method, renormalize=cfg.renormalize, n_group=cfg.n_group,
                            topk_group=cfg.topk_group, scaling=cfg.scaling,
                            bias=bias if cfg.method == "noaux_tc" else None)
    return route_ref(logits, cfg, bias)


def route_ref(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """route's torch form (the reference of the Triton kernel, and the CPU path)."""
    t, e = logits.shape
    logits = logits.float()
    scores = torch.sigmoid(logits) if cfg.scoring == "sigmoid" else torch.softmax(logits, dim=-1)  # [T, E]
    per_group = e // cfg.n_group
    if cfg.method == "noaux_tc":
        choice = scores if bias is None else scores + bias.float()
        top2 = torch.topk(choice.view(t, cfg.n_group, per_group), k=min(2, per_group), dim=-1).values
        mask = _group_mask(top2.sum(dim=-1), cfg.topk_group, per_group)
        ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    elif cfg.method == "group_limited_greedy":
        mask = _group_mask(scores.view(t, cfg.n_group, per_group).amax(dim=-1), cfg.topk_group, per_group)
        # scores are positive: 0 puts the other groups' experts below every kept one
        weights, ids = torch.topk(scores.masked_fill(~mask, 0.0), k=cfg.top_k, dim=-1, sorted=False)
    else:
        weights, ids = torch.topk(scores, k=cfg.top_k, dim=-1, sorted=False)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.scaling != 1.0:
        weights = weights * cfg.scaling
    return weights, ids.to(torch.int32)
