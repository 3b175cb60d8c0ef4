"""Mixtral: every layer sparse, experts named w1 (gate), w3 (up), w2 (down), top-k renormalized."""

from __future__ import annotations

from hybridmoe.models.base import ArchSpec


def mixtral_spec(cfg) -> ArchSpec:
    return ArchSpec(
        name="mixtral",
        moe_module="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
        renormalize=True,
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        moe_intermediate=cfg.intermediate_size,
        moe_layers=tuple(range(cfg.num_hidden_layers)),
    )
