"""Test helper: a tiny Hugging Face MoE checkpoint written as a GGUF file the way llama.cpp's
converter lays it out (its own tensor-name table here, independent of hybridmoe/gguf/names.py, so
a wrong mapping there fails the tests): metadata `{arch}.*`, the tokenizer as `tokenizer.ggml.*`,
routed experts merged into `blk.L.ffn_{gate,up,down}_exps.weight` and quantized (one type per
layer), 1-D tensors F32, other tensors F16, q/k rows permuted for the llama architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file

from hybridmoe.cpu import gguf_quant as gq

DEMO = Path(__file__).resolve().parents[2] / "hybridmoe" / "demo_model"
# llama.cpp's names (gguf-py constants.py TENSOR_NAMES), Hugging Face suffix -> GGUF suffix
LLAMACPP = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
EXPERT_PROJ = {"qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def llamacpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out: per head, row r of the first half and
    row r of the second half become neighbours."""
    d = w.shape[0] // heads
    out = torch.empty_like(w)
    for h in range(heads):
        for r in range(d // 2):
            out[h * d + 2 * r] = w[h * d + r]
            out[h * d + 2 * r + 1] = w[h * d + d // 2 + r]
    return out


def f16_exact(ckpt: Path) -> None:
    """Round the checkpoint's non-expert tensors to float16 values in place (the GGUF stores them as
    F16), so that the GGUF and the directory hold the same numbers."""
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    save_file({k: (v if ".experts." in k or v.dim() == 1 else v.half().to(v.dtype)) for k, v in t.items()}, str(f),
              metadata={"format": "pt"})


def add_tokenizer(w: GGUFWriter, tok_dir: Path = DEMO, chat_template: str | None = None) -> None:
    """The demo model's byte-level BPE as llama.cpp's converter writes a gpt2-type vocabulary (chat_template: in
    place of the demo model's)."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    for a in tj["added_tokens"]:
        vocab.setdefault(a["content"], a["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 CONTROL, 1 NORMAL
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_pad_token_id(vocab[tc["pad_token"]])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_chat_template(tc["chat_template"] if chat_template is None else chat_template)


def write_model_gguf(ckpt: Path, path: Path, layer_types: tuple[str, ...], arch: str = "qwen3moe",
                     experts_only: bool = False, tokenizer: bool = True,
                     chat_template: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint `ckpt` as a GGUF at `path` (layer L's experts in layer_types[L]; experts_only:
    only the expert tensors and the block count, as --kt-weight-path needs). Returns the dequantized
    expert weights by checkpoint name."""
    cfg = json.loads((ckpt / "config.json").read_text())
    t = load_file(str(ckpt / "model.safetensors"))
    n_layers, family = cfg["num_hidden_layers"], "mixtral" if arch == "llama" else "qwen"
    moe_mod, projs = EXPERT_PROJ[family]
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_expert_count(n_exp)
    if not experts_only:
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta")))
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if family == "qwen":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            if arch == "qwen3moe":
                w.add_key_length(cfg["head_dim"])
                w.add_value_length(cfg["head_dim"])
            else:
                w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if tokenizer:
            add_tokenizer(w, chat_template=chat_template)
        top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        for name, v in t.items():
            if ".experts." in name:
                continue
            if name in top:
                gname = top[name]
            else:
                layer, suffix = name.split(".", 3)[2], name.split(".", 3)[3]
                gname = f"blk.{layer}.{LLAMACPP[suffix]}"
                if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                    v = llamacpp_permute(v, heads if "q_proj" in suffix else kv)
                if suffix == "mlp.shared_expert_gate.weight":
                    v = v.reshape(-1)  # llama.cpp stores it as a vector
            arr = v.float().numpy() if v.dim() == 1 else v.half().numpy()
            w.add_tensor(gname, np.ascontiguousarray(arr))
    deq = {}
    for layer in range(n_layers):
        if f"model.layers.{layer}.{moe_mod}.experts.0.{projs[0]}.weight" not in t:
            continue
        typ = layer_types[layer % len(layer_types)]
        for proj, hf in zip(("gate", "up", "down"), projs):
            stack = torch.stack([t[f"model.layers.{layer}.{moe_mod}.experts.{e}.{hf}.weight"] for e in range(n_exp)])
            rows = gq.quantize(stack.float(), typ)
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", rows.numpy(), raw_dtype=GGMLQuantizationType[typ])
            back = gq.dequantize(rows, typ)
            for e in range(n_exp):
                deq[f"model.layers.{layer}.{moe_mod}.experts.{e}.{hf}.weight"] = back[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def with_experts(ckpt: Path, out: Path, deq: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint directory whose experts are `deq` (the GGUF's, dequantized)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors.update({k: v.to(tensors[k].dtype) for k, v in deq.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
