"""Hugging Face parameter names -> llama.cpp GGUF tensor names, and llama.cpp's q/k row permutation.

    gguf_name("model.layers.3.mlp.experts.5.up_proj.weight")  # ("blk.3.ffn_up_exps.weight", 5)

Routed experts are one 3-D tensor per projection in the GGUF ([E, N, K]): the expert index comes
back with the name. llama.cpp's converter permutes the q and k rows of llama-architecture models
(Mixtral) for its interleaved rope (`permute` in convert_hf_to_gguf.py): within each head the rows
go from [first half, second half] (Hugging Face's rotate_half) to pairs (0, h/2), (1, h/2+1), ...;
`unpermute_rows` undoes that. qwen2moe / qwen3moe use NEOX rope in llama.cpp: no permutation; deepseek2 neither (its rope is
applied to adjacent pairs of the checkpoint's own rows, see gguf/deepseek2.py).
"""

from __future__ import annotations

import re

import torch

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {  # suffix after model.layers.{L}. -> suffix after blk.{L}.
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # DeepSeek (deepseek2): MLA, shared experts, the router's selection bias
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# the GGUF architectures whose q/k rows llama.cpp's converter permutes
PERMUTED_QK = ("llama",)


def gguf_name(hf: str) -> tuple[str, int | None] | None:
    """(GGUF tensor name, expert index or None) of a Hugging Face parameter, None if it has none."""
    if hf in _TOP:
        return _TOP[hf], None
    m = _EXPERT.match(hf)
    if m:
        proj = _PROJ.get(m[3])
        return (f"blk.{m[1]}.ffn_{proj}_exps.weight", int(m[2])) if proj else None
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER:
        return f"blk.{parts[2]}.{_LAYER[parts[3]]}", None
    return None


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation of a q or k weight [heads * D, ...] (or bias): Hugging Face -> GGUF."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of permute_rows: GGUF -> Hugging Face."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
