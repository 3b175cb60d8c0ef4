"""DeepSeek-V2 / V2.5 / V2-Lite and DeepSeek-V3 / R1 / V3.1 (and Kimi-K2, a V3 architecture):
multi-head latent attention, the first `first_k_dense_replace` layers dense (then every
`moe_layer_freq`-th layer MoE), routed experts named gate_proj/up_proj/down_proj, shared experts
`mlp.shared_experts` (one MLP of n_shared_experts * moe_intermediate_size, no gate), the router
`mlp.gate` in float32 with, for V3, `e_score_correction_bias`.

Routing follows transformers' modeling_deepseek_v3 / _v2: V3 sigmoid scores with noaux_tc grouped
selection (whatever topk_method / scoring_func say, as transformers); V2 softmax with topk_method greedy or group_limited_greedy; both times
routed_scaling_factor. V3 renormalizes when norm_topk_prob. V2: transformers ignores norm_topk_prob
(the published V2 configs set it false); here true renormalizes before the scaling, as for V3.
"""

from __future__ import annotations

import logging

from hybridmoe.layers.attention.mla import MLAConfig
from hybridmoe.models.base import ArchSpec
from hybridmoe.moe.routing import RoutingConfig

log = logging.getLogger(__name__)


def _moe_layers(cfg) -> tuple[int, ...]:
    if not getattr(cfg, "n_routed_experts", None):
        return ()
    first = getattr(cfg, "first_k_dense_replace", None) or 0
    freq = getattr(cfg, "moe_layer_freq", None) or 1
    return tuple(i for i in range(cfg.num_hidden_layers) if i >= first and i % freq == 0)


def _mla(cfg, interleaved: bool) -> MLAConfig:
    return MLAConfig(q_lora_rank=getattr(cfg, "q_lora_rank", None) or None, kv_lora_rank=cfg.kv_lora_rank,
                     qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                     v_head_dim=cfg.v_head_dim, interleaved_rope=interleaved,
                     bias=bool(getattr(cfg, "attention_bias", False)))


def _spec(cfg, name: str, routing: RoutingConfig, score_bias: bool, interleaved: bool) -> ArchSpec:
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{name}: mlp_bias is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act {cfg.hidden_act!r} is not supported (silu only)")
    return ArchSpec(
        name=name,
        moe_module="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=routing.renormalize,
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        moe_intermediate=cfg.moe_intermediate_size,
        dense_intermediate=cfg.intermediate_size,
        shared_intermediate=(getattr(cfg, "n_shared_experts", None) or 0) * cfg.moe_intermediate_size,
        moe_layers=_moe_layers(cfg),
        shared_name="shared_experts",
        shared_gated=False,
        routing=routing,
        router_fp32=True,
        score_bias=score_bias,
        mla=_mla(cfg, interleaved),
    )


def deepseek_v3_spec(cfg) -> ArchSpec:
    method = getattr(cfg, "topk_method", None) or "noaux_tc"
    scoring = getattr(cfg, "scoring_func", None) or "sigmoid"
    if method != "noaux_tc" or scoring != "sigmoid":
        # not refused here: model_check reports a value outside the known ones, naming config.json
        log.warning("deepseek_v3: topk_method %r / scoring_func %r ignored: DeepseekV3ForCausalLM routes with "
                    "noaux_tc over sigmoid scores (as transformers does)", method, scoring)
    routing = RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="sigmoid", method="noaux_tc",
                            renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
                            n_group=getattr(cfg, "n_group", None) or 1, topk_group=getattr(cfg, "topk_group", None) or 1,
                            scaling=float(getattr(cfg, "routed_scaling_factor", None) or 1.0))
    interleaved = getattr(cfg, "rope_interleave", None)
    return _spec(cfg, "deepseek_v3", routing, score_bias=True, interleaved=True if interleaved is None else
                 bool(interleaved))


def deepseek_v2_spec(cfg) -> ArchSpec:
    method = getattr(cfg, "topk_method", None) or "greedy"
    scoring = getattr(cfg, "scoring_func", None) or "softmax"
    if method not in ("greedy", "group_limited_greedy") or scoring != "softmax":
        raise ValueError(f"deepseek_v2: topk_method {method!r} with scoring_func {scoring!r} is not supported "
                         "(greedy or group_limited_greedy over softmax scores)")
    grouped = method == "group_limited_greedy"
    routing = RoutingConfig(top_k=cfg.num_experts_per_tok, scoring="softmax", method=method,
                            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                            n_group=(getattr(cfg, "n_group", None) or 1) if grouped else 1,
                            topk_group=(getattr(cfg, "topk_group", None) or 1) if grouped else 1,
                            scaling=float(getattr(cfg, "routed_scaling_factor", None) or 1.0))
    return _spec(cfg, "deepseek_v2", routing, score_bias=False, interleaved=True)  # V2 always rotates pairs
