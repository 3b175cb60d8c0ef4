"""Qwen2-MoE: qkv bias, a shared expert scaled by a sigmoid gate, Qwen-style sparse layer rule."""

from __future__ import annotations

from hybridmoe.models.base import ArchSpec
from hybridmoe.models.qwen3_moe import sparse_layers


def qwen2_moe_spec(cfg) -> ArchSpec:
    return ArchSpec(
        name="qwen2_moe",
        moe_module="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
        renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        moe_intermediate=cfg.moe_intermediate_size,
        dense_intermediate=cfg.intermediate_size,
        shared_intermediate=cfg.shared_expert_intermediate_size,
        moe_layers=sparse_layers(cfg),
    )
