"""Model shapes for the benchmarks: the published DeepSeek-V3 and Kimi-K2 configs (random weights,
real shapes), cut to `layers` decoder layers for a depth that fits the host's RAM.

`--dummy-deepseek-v3` / `--dummy-kimi-k2` (add_dummy_flags) pick one in every benchmark script that
builds a model; `--layers N` then counts all decoder layers, of which the first
min(first_k_dense_replace, N - 1) stay dense, so at least one is MoE. The scripts' own shape flags
(--hidden, --experts, ...) are set from the chosen config (apply_dummy_shape), so what they print
and compute (bytes per token, vocabulary of the random prompts) is that model's.

Legend: L layers, E routed experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import argparse
import copy

# DeepSeek-V3 (also V3-0324, R1, V3.1): deepseek-ai/DeepSeek-V3 config.json
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}

# Kimi-K2 (moonshotai/Kimi-K2-Instruct): the DeepSeek-V3 architecture with 384 experts, one expert group,
# 64 heads, one dense layer
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840,
}

DUMMY_MODELS = {"deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2}


def dummy_config(name: str, layers: int | None = None, fp8: bool = True) -> dict:
    """The config.json dict of model `name` (a DUMMY_MODELS key), with `layers` decoder layers (None:
    all of them; the dense ones first, at least one MoE layer), without its fp8 quantization_config
    when not `fp8` (bf16 weights)."""
    cfg = copy.deepcopy(DUMMY_MODELS[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers}: expected at least 1")
        cfg["num_hidden_layers"] = layers
        cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], layers - 1)
    if not fp8:
        cfg.pop("quantization_config")
    return cfg


def add_dummy_flags(p: argparse.ArgumentParser) -> None:
    """--dummy-deepseek-v3 / --dummy-kimi-k2 (one at most) and --dummy-bf16."""
    g = p.add_mutually_exclusive_group()
    for name in DUMMY_MODELS:
        g.add_argument(f"--dummy-{name}", dest="dummy_model", action="store_const", const=name,
                       help=f"the {name} shape (published config, random weights); --layers N cuts its depth")
    p.add_argument("--dummy-bf16", action="store_true",
                   help="with --dummy-*: without the checkpoint's fp8 quantization_config (bf16 weights)")


def shape_flags(cfg: dict) -> dict:
    """The scripts' shape flags as `cfg` gives them (the names of bench_decode.add_shape_args and of
    bench_cpu_moe: E, k, H, I)."""
    return {"layers": cfg["num_hidden_layers"], "experts": cfg["n_routed_experts"], "topk": cfg["num_experts_per_tok"],
            "hidden": cfg["hidden_size"], "inter": cfg["moe_intermediate_size"], "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"], "head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
            "vocab": cfg["vocab_size"], "E": cfg["n_routed_experts"], "k": cfg["num_experts_per_tok"],
            "H": cfg["hidden_size"], "I": cfg["moe_intermediate_size"]}


def apply_dummy_shape(a: argparse.Namespace, default_layers: int) -> dict | None:
    """With a --dummy-* flag: a.dummy_config (the config dict, depth a.layers if given) and the shape
    flags the namespace has set from it; returns the config. Without one: a.layers defaults to
    `default_layers` (the script's own shape), None is returned."""
    name = getattr(a, "dummy_model", None)
    if name is None:
        if getattr(a, "layers", None) is None:
            a.layers = default_layers
        return None
    cfg = dummy_config(name, getattr(a, "layers", None), fp8=not getattr(a, "dummy_bf16", False))
    for key, value in shape_flags(cfg).items():
        if hasattr(a, key):
            setattr(a, key, value)
    a.dummy_config = cfg
    return cfg
