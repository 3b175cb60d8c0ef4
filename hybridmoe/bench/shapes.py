"""Published model shapes for benchmarks and sizing without a checkpoint: a directory holding only
config.json, served with `--load-format dummy` (random weights) and `--skip-tokenizer-init`."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

# Qwen/Qwen3-30B-A3B config.json (the fields the engine reads)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False,
}
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B}


def shape_config(name: str, layers: int | None = None) -> dict:
    """The config dict of a named shape, cut to `layers` decoder layers when given. Raises ConfigError (a
    ValueError), which the commands print as one line without a type name."""
    from hybridmoe.config import ConfigError

    if name not in SHAPES:
        raise ConfigError(f"--shape {name!r}: expected one of {sorted(SHAPES)}")
    cfg = copy.deepcopy(SHAPES[name])
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers: got {layers}, expected at least 1")
        cfg["num_hidden_layers"] = layers
    return cfg


def write_shape_dir(name: str, out: str | Path | None = None, layers: int | None = None) -> Path:
    """A model directory with the shape's config.json (a new temporary directory when `out` is None)."""
    d = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"hybridmoe-{name}-"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(shape_config(name, layers), indent=1))
    return d
