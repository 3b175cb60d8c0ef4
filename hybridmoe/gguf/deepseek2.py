"""llama.cpp's `deepseek2` GGUF architecture (DeepSeek-V2 / V2.5 / V2-Lite, V3 / R1, Kimi-K2): the
Hugging Face config from its metadata, and kv_b_proj from the split k_b / v_b tensors.

What llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes, and how it maps back:
- `deepseek2.expert_gating_func` 2 (sigmoid) -> DeepseekV3ForCausalLM (noaux_tc over sigmoid scores,
  the bias `blk.L.exp_probs_b.bias`); 1 (softmax) or absent (llama.cpp's default for old V2 files)
  -> DeepseekV2ForCausalLM (greedy, or group_limited_greedy with expert groups).
- `leading_dense_block_count` = first_k_dense_replace; `expert_shared_count` = n_shared_experts;
  `expert_weights_scale` = routed_scaling_factor; `expert_weights_norm` = norm_topk_prob;
  `expert_group_count` / `expert_group_used_count` = n_group / topk_group (newer converters only).
- `attention.q_lora_rank` (absent: q_proj, no LoRA), `attention.kv_lora_rank`; the head sizes in two
  forms: newer files `key_length` = kv_lora + rope and `key_length_mla` = nope + rope (value_length
  / value_length_mla likewise), older ones `key_length` = nope + rope, `value_length` = v_head_dim.
  `head_count_kv` is 1 in newer files (MLA as MQA): ignored, MLA has one KV head per query head.
- `rope.dimension_count` = qk_rope_head_dim. The rope channels are NOT permuted: llama.cpp runs
  deepseek2 with its "normal" rope (adjacent pairs), which is DeepSeek's interleaved rope on the
  checkpoint's own rows, so rope_interleave is true.
- YaRN: `rope.scaling.{type,factor,original_context_length}` and `yarn_log_multiplier` = 0.1 *
  mscale_all_dim; llama.cpp takes mscale = mscale_all_dim (it cannot store both), so do we.
- kv_b_proj [H*(nope+v), kv_lora] is `attn_kv_b` in older files; newer ones split it per head into
  `attn_k_b` [H, kv_lora, nope] (transposed) and `attn_v_b` [H, v, kv_lora] (torch order).

Sizes are checked against the tensor shapes, which every file has.
"""

from __future__ import annotations

from typing import Any

import torch

GATING_SOFTMAX, GATING_SIGMOID = 1, 2


class DeepSeek2ConfigError(ValueError):
    """deepseek2 metadata this engine cannot serve (raised as GGUFConfigError by model_config)."""


def _rows(shapes: dict[str, tuple[int, ...]], name: str) -> int | None:
    s = shapes.get(name)
    return int(s[0]) if s is not None else None


def _attention(key, shapes: dict[str, tuple[int, ...]], heads: int, source: str) -> dict[str, Any]:
    """q_lora_rank, kv_lora_rank, qk_nope/rope/v head dims (metadata, checked against the tensors)."""
    rope = key("rope.dimension_count")
    kv_lora = key("attention.kv_lora_rank") or (shapes.get("blk.0.attn_kv_a_norm.weight") or (None,))[0]
    if rope is None or kv_lora is None:
        raise DeepSeek2ConfigError(f"{source}: deepseek2 metadata lacks rope.dimension_count or "
                                   "attention.kv_lora_rank")
    rope, kv_lora = int(rope), int(kv_lora)
    if key("attention.key_length_mla") is not None:  # the newer (MQA) form
        qk_head, v_head = int(key("attention.key_length_mla")), key("attention.value_length_mla")
    else:
        qk_head, v_head = key("attention.key_length"), key("attention.value_length")
    q_rows = _rows(shapes, "blk.0.attn_q.weight") or _rows(shapes, "blk.0.attn_q_b.weight")
    if q_rows is not None:
        qk_head = q_rows // heads  # the tensors are the truth
    if qk_head is None:
        raise DeepSeek2ConfigError(f"{source}: no attention.key_length_mla / key_length and no attn_q tensor")
    nope = int(qk_head) - rope
    if "blk.0.attn_v_b.weight" in shapes:
        v_head = shapes["blk.0.attn_v_b.weight"][1]
    elif "blk.0.attn_kv_b.weight" in shapes:
        v_head = shapes["blk.0.attn_kv_b.weight"][0] // heads - nope
    if v_head is None or nope <= 0:
        raise DeepSeek2ConfigError(f"{source}: MLA head sizes do not follow from the metadata (qk head "
                                   f"{qk_head}, rope {rope}, v head {v_head})")
    q_lora = key("attention.q_lora_rank") or _rows(shapes, "blk.0.attn_q_a.weight")
    return {"q_lora_rank": int(q_lora) if q_lora else None, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope, "v_head_dim": int(v_head), "qk_head_dim": int(qk_head), "head_dim": rope,
            "rope_interleave": True, "attention_bias": False}


def _rope(key, n_ctx: int) -> dict[str, Any]:
    """rope_parameters (transformers 5 form) of the file's RoPE and YaRN keys."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    if key("rope.scaling.type") != "yarn":
        return out
    out.update(rope_type="yarn", factor=float(key("rope.scaling.factor", 1.0)),
               original_max_position_embeddings=int(key("rope.scaling.original_context_length", n_ctx)),
               beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
               beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)))
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if log_mul:  # the converter stored 0.1 * mscale_all_dim; llama.cpp uses it for mscale as well
        m = round(float(log_mul) / 0.1, 6)  # undo the float32 rounding of the stored product
        out.update(mscale=m, mscale_all_dim=m)
    return out


def deepseek2_config(key, shapes: dict[str, tuple[int, ...]], common: dict[str, Any], moe: list[int],
                     source: str) -> dict[str, Any]:
    """config.json of a deepseek2 file: `common` holds the keys every architecture shares (built by
    model_config.hf_config), `key(name, default)` reads `deepseek2.{name}`, `moe` the layers with
    routed experts."""
    n_layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    nextn = int(key("nextn_predict_layers", 0) or 0)
    n_layers -= nextn  # MTP blocks counted in block_count (not written by llama.cpp's deepseek2 converter)
    moe = [i for i in moe if i < n_layers]
    first = key("leading_dense_block_count")
    first = int(first) if first is not None else moe[0]
    if moe != list(range(first, n_layers)):
        raise DeepSeek2ConfigError(f"{source}: routed experts in layers {moe}, but leading_dense_block_count "
                                   f"{first} of {n_layers} layers means layers {first}..{n_layers - 1}")
    experts, moe_inter, _ = shapes[f"blk.{moe[0]}.ffn_gate_exps.weight"]
    gating = int(key("expert_gating_func", GATING_SOFTMAX) or GATING_SOFTMAX)
    has_bias = f"blk.{moe[0]}.exp_probs_b.bias" in shapes
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise DeepSeek2ConfigError(f"{source}: deepseek2.expert_gating_func {gating} is not served (1 softmax: "
                                   "DeepSeek-V2, 2 sigmoid: DeepSeek-V3)")
    if has_bias != (gating == GATING_SIGMOID):
        raise DeepSeek2ConfigError(f"{source}: {'sigmoid' if gating == GATING_SIGMOID else 'softmax'} expert "
                                   f"gating {'without' if not has_bias else 'with'} exp_probs_b tensors is "
                                   "neither DeepSeek-V3 (sigmoid + bias) nor DeepSeek-V2 (softmax)")
    shared_rows = _rows(shapes, f"blk.{moe[0]}.ffn_gate_shexp.weight") or 0
    n_shared = key("expert_shared_count")
    n_shared = int(n_shared) if n_shared is not None else shared_rows // int(moe_inter)
    if shared_rows != n_shared * int(moe_inter):
        raise DeepSeek2ConfigError(f"{source}: ffn_gate_shexp has {shared_rows} rows, expert_shared_count "
                                   f"{n_shared} x expert size {moe_inter} needs {n_shared * int(moe_inter)}")
    groups, used = int(key("expert_group_count", 1) or 1), int(key("expert_group_used_count", 1) or 1)
    dense = _rows(shapes, "blk.0.ffn_gate.weight") if first else None
    v3 = gating == GATING_SIGMOID
    cfg = dict(common)
    cfg.pop("head_dim", None)
    cfg.update(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if v3 else "deepseek_v2", num_hidden_layers=n_layers, num_key_value_heads=heads,
        n_routed_experts=int(experts), moe_intermediate_size=int(moe_inter), n_shared_experts=n_shared,
        first_k_dense_replace=first, moe_layer_freq=1, num_nextn_predict_layers=nextn,
        intermediate_size=int(dense or key("feed_forward_length") or moe_inter),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(key("expert_weights_norm", False)), n_group=groups, topk_group=used,
        scoring_func="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
        rope_parameters=_rope(key, common["max_position_embeddings"]),
        **_attention(key, shapes, heads, source))
    cfg.pop("rope_theta", None)
    return cfg


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [H*(nope+v), kv_lora] from attn_k_b [H, kv_lora, nope] and attn_v_b [H, v, kv_lora]:
    per head, the nope (key) rows, then the value rows, as the Hugging Face checkpoint has them."""
    h, lora = k_b.shape[0], k_b.shape[1]
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, lora) if h else k_b.new_empty(0, lora)

