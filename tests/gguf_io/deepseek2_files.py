"""Test helper: a tiny Hugging Face DeepSeek-V2/V3 checkpoint written as a `deepseek2` GGUF the way
llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model, and TextModel's common keys) lays
it out. Its own name table (gguf-py's tensor_mapping / constants), independent of
hybridmoe/gguf/names.py, so that a wrong mapping there fails the tests.

Two forms: `split=True` (converters since llama.cpp's MLA change: head_count_kv 1, key/value_length
of the latent, key_length_mla / value_length_mla, kv_b_proj split into attn_k_b (transposed) and
attn_v_b) and `split=False` (older converters: one attn_kv_b, key_length nope + rope, value_length
v_head_dim); `groups=False` leaves out the expert group keys (files before late 2025). Nothing is permuted (llama.cpp runs deepseek2 with
its adjacent-pairs rope on the checkpoint's rows). 1-D tensors and the router ffn_gate_inp are F32
(llama.cpp keeps the router in F32), other non-expert tensors F16, routed experts quantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf_files import add_tokenizer
from safetensors.torch import load_file, save_file

from hybridmoe.cpu import gguf_quant as gq

NAMES = {  # Hugging Face suffix after model.layers.{L}. -> llama.cpp's after blk.{L}.
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",  # renamed e_score_correction.bias by the converter
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def stored_f32(name: str, v: torch.Tensor) -> bool:
    return v.dim() == 1 or name.endswith("mlp.gate.weight")


def f16_exact_deepseek(ckpt: Path) -> None:
    """Round the tensors the GGUF stores as F16 to float16 values in the directory too."""
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    save_file({k: v if ".experts." in k or stored_f32(k, v) else v.half().to(v.dtype) for k, v in t.items()},
              str(f), metadata={"format": "pt"})


def _metadata(w: GGUFWriter, cfg: dict, split: bool, groups: bool) -> None:
    heads, rope = cfg["num_attention_heads"], cfg["qk_rope_head_dim"]
    nope, v, lora = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    rp = cfg.get("rope_parameters") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if split else cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if groups and cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    sigmoid = cfg["model_type"] == "deepseek_v3"  # V3's config says scoring_func sigmoid, V2's softmax
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if sigmoid else ExpertGatingFuncType.SOFTMAX)
    if rp.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        if split:
            w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(lora)
    if split:
        w.add_key_length(lora + rope)
        w.add_value_length(lora)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)


def write_deepseek2_gguf(ckpt: Path, path: Path, layer_types: tuple[str, ...], split: bool = True,
                         groups: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint as a deepseek2 GGUF (MoE layer L's experts in layer_types[L % len]); groups:
    write expert_group_count / _used_count (converters since late 2025; files before have neither).
    Returns the dequantized expert weights by checkpoint name."""
    cfg = json.loads((ckpt / "config.json").read_text())
    t = load_file(str(ckpt / "model.safetensors"))
    heads, nope, v_dim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w = GGUFWriter(str(path), "deepseek2")
    _metadata(w, cfg, split, groups)
    add_tokenizer(w)

    def add(name: str, v: torch.Tensor, f32: bool) -> None:
        w.add_tensor(name, np.ascontiguousarray(v.float().numpy() if f32 else v.half().numpy()))

    for name, v in t.items():
        if ".experts." in name:
            continue
        if name in TOP:
            add(TOP[name], v, v.dim() == 1)
            continue
        layer, suffix = name.split(".", 3)[2], name.split(".", 3)[3]
        if split and suffix == "self_attn.kv_b_proj.weight":  # the converter's split, written out
            kv_b = v.reshape(heads, nope + v_dim, v.shape[-1])
            add(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].transpose(1, 2).contiguous(), False)
            add(f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:].contiguous(), False)
            continue
        add(f"blk.{layer}.{NAMES[suffix]}", v, stored_f32(name, v))
    deq = {}
    n_exp = cfg["n_routed_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        if f"model.layers.{layer}.mlp.experts.0.gate_proj.weight" not in t:
            continue
        typ = layer_types[layer % len(layer_types)]
        for proj in ("gate", "up", "down"):
            hf = f"{proj}_proj"
            stack = torch.stack([t[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"] for e in range(n_exp)])
            rows = gq.quantize(stack.float(), typ)
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", rows.numpy(), raw_dtype=GGMLQuantizationType[typ])
            back = gq.dequantize(rows, typ)
            for e in range(n_exp):
                deq[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"] = back[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq
