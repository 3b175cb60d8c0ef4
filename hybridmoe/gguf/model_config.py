"""A Hugging Face config.json (as a dict) from a GGUF file's metadata and tensor shapes.

Our own mapping, not transformers' (integrations.ggml.GGUF_CONFIG_MAPPING): in transformers 5.24 it
maps neither moe_intermediate_size (qwen3moe, qwen2moe) nor the shared expert's size, and it reads a
llama-architecture file with experts (Mixtral) as a dense Llama. Sizes the metadata may lack are taken
from the tensor shapes, which every file has. The metadata values it reads are checked first, by type
and range (gguf/metadata.py), and the sizes against the tensors, as llama.cpp's loader checks them.

llama.cpp architecture -> ours: qwen3moe -> Qwen3MoeForCausalLM, qwen2moe -> Qwen2MoeForCausalLM,
llama with {arch}.expert_count > 0 -> MixtralForCausalLM, deepseek2 -> DeepseekV3ForCausalLM or
DeepseekV2ForCausalLM (gguf/deepseek2.py).
"""

from __future__ import annotations

from typing import Any

from hybridmoe.gguf.metadata import GGUFConfigError, check_metadata

ARCHS = {"qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
         "llama": ("MixtralForCausalLM", "mixtral"), "deepseek2": ("DeepseekV3ForCausalLM", "deepseek_v3")}


def _moe_layers(shapes: dict[str, tuple[int, ...]], n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if f"blk.{i}.ffn_gate_exps.weight" in shapes]


def _first(shapes: dict[str, tuple[int, ...]], names: list[str], dim: int) -> int | None:
    for n in names:
        if n in shapes:
            return int(shapes[n][dim])
    return None


def _mismatch(source: str, key: str, value: int, what: str) -> GGUFConfigError:
    return GGUFConfigError(f"{source}: metadata {key} is {value}, but {what}: the file is damaged or was edited")


def _check_against_tensors(meta: dict[str, Any], arch: str, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """The sizes the config takes from the metadata agree with the tensors llama.cpp would create from
    them (it refuses a file where they do not): a damaged count is named here, not met later as a
    shape error, a division by zero or a loop over 2**62 layers."""
    n_layers = meta[f"{arch}.block_count"]
    last = max((int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.split(".")[1].isdigit()),
               default=-1)
    mtp = meta.get(f"{arch}.nextn_predict_layers") or 0  # multi-token-prediction blocks a file may leave out
    if n_layers > last + 1 + mtp:
        raise _mismatch(source, f"{arch}.block_count", n_layers,
                        f"the tensors stop at blk.{last}" if last >= 0 else "the file has no blk.N tensors")
    hidden = meta[f"{arch}.embedding_length"]
    embd = _first(shapes, ["token_embd.weight"], -1)
    if embd is not None and hidden != embd:
        raise _mismatch(source, f"{arch}.embedding_length", hidden, f"token_embd.weight has rows of {embd}")
    for heads_key, tensor in (("attention.head_count", "blk.0.attn_q.weight"),
                              ("attention.head_count_kv", "blk.0.attn_k.weight")):
        heads, rows = meta.get(f"{arch}.{heads_key}"), _first(shapes, [tensor], 0)
        if heads is not None and rows is not None and rows % heads:
            raise _mismatch(source, f"{arch}.{heads_key}", heads, f"{tensor}'s {rows} rows are no whole number of "
                            "heads")


def _check_experts(meta: dict[str, Any], arch: str, experts: int, tensor: str, source: str) -> None:
    """expert_count, if given, is the experts' tensors' count, and expert_used_count at most that."""
    count = meta.get(f"{arch}.expert_count")
    if count is not None and count != experts:
        raise _mismatch(source, f"{arch}.expert_count", count, f"{tensor} holds {experts} experts")
    used = meta.get(f"{arch}.expert_used_count")
    if used is not None and used > experts:
        raise _mismatch(source, f"{arch}.expert_used_count", used, f"{tensor} holds only {experts} experts")


def hf_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """config.json content for the model of this metadata; `shapes` in torch order ([E, N, K] for
    the 3-D expert tensors, [N, K] for linears). `source` names the file in errors."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHS:
        raise GGUFConfigError(f"{source}: general.architecture {arch!r} is not served from a GGUF (supported: "
                              f"{', '.join(sorted(ARCHS))} with experts)")

    check_metadata(meta, arch, source)  # types and ranges: int() below and the layer loop rely on them

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}")
        return default if value is None else value

    n_layers = key("block_count")
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    if n_layers is None or hidden is None or heads is None:
        raise GGUFConfigError(f"{source}: metadata lacks {arch}.block_count, .embedding_length or "
                              ".attention.head_count")
    _check_against_tensors(meta, arch, shapes, source)
    moe = _moe_layers(shapes, n_layers)
    if not moe:
        if any(f"blk.0.ffn_gate.{e}.weight" in shapes for e in range(2)):
            raise GGUFConfigError(f"{source}: experts stored one tensor per expert (blk.N.ffn_gate.E.weight, an old "
                                  "llama.cpp layout); convert it again with a current llama.cpp (merged *_exps tensors)")
        raise GGUFConfigError(f"{source}: no blk.N.ffn_gate_exps.weight tensor: not a mixture-of-experts model")
    experts, moe_inter, _ = shapes[f"blk.{moe[0]}.ffn_gate_exps.weight"]
    _check_experts(meta, arch, experts, f"blk.{moe[0]}.ffn_gate_exps.weight", source)
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
