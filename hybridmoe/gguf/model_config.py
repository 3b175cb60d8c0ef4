"""A Hugging Face config.json (as a dict) from a GGUF file's metadata and tensor shapes.

Our own mapping, not transformers' (integrations.ggml.GGUF_CONFIG_MAPPING): in transformers 5.24 it
maps neither moe_intermediate_size (qwen3moe, qwen2moe) nor the shared expert's size, and it reads a
llama-architecture file with experts (Mixtral) as a dense Llama. Sizes the metadata may lack are taken
from the tensor shapes, which every file has.

llama.cpp architecture -> ours: qwen3moe -> Qwen3MoeForCausalLM, qwen2moe -> Qwen2MoeForCausalLM,
llama with {arch}.expert_count > 0 -> MixtralForCausalLM, deepseek2 -> DeepseekV3ForCausalLM or
DeepseekV2ForCausalLM (gguf/deepseek2.py).
"""

from __future__ import annotations

from typing import Any

ARCHS = {"qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
         "llama": ("MixtralForCausalLM", "mixtral"), "deepseek2": ("DeepseekV3ForCausalLM", "deepseek_v3")}


class GGUFConfigError(ValueError):
    """Metadata that describes no model this engine serves."""


def _moe_layers(shapes: dict[str, tuple[int, ...]], n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if f"blk.{i}.ffn_gate_exps.weight" in shapes]


def _first(shapes: dict[str, tuple[int, ...]], names: list[str], dim: int) -> int | None:
    for n in names:
        if n in shapes:
            return int(shapes[n][dim])
    return None


def hf_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """config.json content for the model of this metadata; `shapes` in torch order ([E, N, K] for
    the 3-D expert tensors, [N, K] for linears). `source` names the file in errors."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHS:
        raise GGUFConfigError(f"{source}: general.architecture {arch!r} is not served from a GGUF (supported: "
                              f"{', '.join(sorted(ARCHS))} with experts)")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    n_layers = key("block_count")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    if n_layers is None or hidden is None or heads is None:
        raise GGUFConfigError(f"{source}: metadata lacks {arch}.block_count, .embedding_length or "
                              ".attention.head_count")
    n_layers, hidden, heads = int(n_layers), int(hidden), int(heads)
    moe = _moe_layers(shapes, n_layers)
    if not moe:
        if any(f"blk.0.ffn_gate.{e}.weight" in shapes for e in range(2)):
            raise GGUFConfigError(f"{source}: experts stored one tensor per expert (blk.N.ffn_gate.E.weight, an old "
                                  "llama.cpp layout); convert it again with a current llama.cpp (merged *_exps tensors)")
        raise GGUFConfigError(f"{source}: no blk.N.ffn_gate_exps.weight tensor: not a mixture-of-experts model")
    experts, moe_inter, _ = shapes[f"blk.{moe[0]}.ffn_gate_exps.weight"]
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    q_rows = _first(shapes, ["blk.0.attn_q.weight"], 0)
    if q_rows is not None:
        head_dim = q_rows // heads  # the tensors are the truth (rope.dimension_count may be partial)
    vocab = _first(shapes, ["token_embd.weight"], 0) or len(meta.get("tokenizer.ggml.tokens") or [])
    arch_name, model_type = ARCHS[arch]
    cfg: dict[str, Any] = {
        "architectures": [arch_name], "model_type": model_type, "hidden_size": hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(head_dim), "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)), "vocab_size": int(vocab),
        "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in shapes,
        "num_experts_per_tok": int(key("expert_used_count", 2)), "attention_dropout": 0.0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "bfloat16",
    }
    if arch == "deepseek2":  # MLA, grouped routing, YaRN: its own mapping
        from hybridmoe.gguf.deepseek2 import DeepSeek2ConfigError, deepseek2_config

        try:
            return deepseek2_config(key, shapes, cfg, moe, source)
        except DeepSeek2ConfigError as e:
            raise GGUFConfigError(str(e)) from None
    scaling = key("rope.scaling.type")
    if scaling in ("yarn", "linear"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(key("rope.scaling.factor", 1.0))}
        if key("rope.scaling.original_context_length") is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    if model_type == "mixtral":
        if len(moe) != n_layers:
            raise GGUFConfigError(f"{source}: Mixtral needs experts in every layer; layers "
                                  f"{sorted(set(range(n_layers)) - set(moe))} have none")
        cfg.update(num_local_experts=int(experts), intermediate_size=int(moe_inter), sliding_window=None)
        return cfg
    dense = [i for i in range(n_layers) if i not in moe]
    cfg.update(num_experts=int(experts), moe_intermediate_size=int(moe_inter), decoder_sparse_step=1,
               mlp_only_layers=dense, use_sliding_window=False, sliding_window=None,
               intermediate_size=int(_first(shapes, [f"blk.{dense[0]}.ffn_gate.weight"] if dense else [], 0)
                                     or key("feed_forward_length") or moe_inter))
    # llama.cpp renormalizes the top-k weights of qwen3moe and not of qwen2moe unless the file says so
    cfg["norm_topk_prob"] = bool(key("expert_weights_norm", model_type == "qwen3_moe"))
    if model_type == "qwen3_moe":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in shapes
    else:
        shared = _first(shapes, [f"blk.{moe[0]}.ffn_gate_shexp.weight"], 0)
        cfg["shared_expert_intermediate_size"] = int(shared or key("expert_shared_feed_forward_length", 0))
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in shapes
    return cfg
