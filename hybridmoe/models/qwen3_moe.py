"""Qwen3-MoE: per-head q/k RMSNorm, no qkv bias, MoE layers chosen by mlp_only_layers and
decoder_sparse_step, optional top-k renormalization (norm_topk_prob)."""

from __future__ import annotations

from hybridmoe.models.base import ArchSpec


def sparse_layers(cfg) -> tuple[int, ...]:
    """Layers with a sparse MoE block (Qwen2/3-MoE rule)."""
    only_dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(i for i in range(cfg.num_hidden_layers)
                 if i not in only_dense and cfg.num_experts > 0 and (i + 1) % step == 0)


def qwen3_moe_spec(cfg) -> ArchSpec:
    return ArchSpec(
        name="qwen3_moe",
        moe_module="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        qk_norm=True,
        renormalize=bool(cfg.norm_topk_prob),
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        moe_intermediate=cfg.moe_intermediate_size,
        dense_intermediate=cfg.intermediate_size,
        moe_layers=sparse_layers(cfg),
    )
