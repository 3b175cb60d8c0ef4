"""Top-k routing: softmax over the experts' logits, top-k, optional renormalization.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch


def topk_softmax(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] float32, ids [T, K] int32
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
