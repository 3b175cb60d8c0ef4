"""The model's Hugging Face config -> ModelConfig, once per engine (the arch spec, head dim, sizes)."""

from __future__ import annotations

from typing import Any

from hybridmoe.config import ModelConfig
from hybridmoe.models.registry import arch_spec


def model_config(hf_config: Any, source: str = "config.json") -> ModelConfig:
    """Resolve what the engine reads of `hf_config`; an unsupported architecture is an error naming
    `source` (the config file) and the supported ones."""
    spec = arch_spec(hf_config, source)
    heads = hf_config.num_attention_heads
    mla = spec.mla
    if mla is not None:
        # MLA: transformers 5 sets config.head_dim to qk_rope_head_dim (its rotary reads it); the
        # attention's q/k head is nope + rope, and the cache holds one latent entry per token
        # (kv_lora_rank + qk_rope_head_dim), not per-head K and V
        head_dim, kv_heads = mla.qk_head_dim, heads
    else:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return ModelConfig(hf=hf_config, spec=spec, source=source, num_layers=hf_config.num_hidden_layers,
                       hidden_size=hf_config.hidden_size, vocab_size=hf_config.vocab_size, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position=getattr(hf_config, "max_position_embeddings", None) or 4096,
                       kv_lora_rank=mla.kv_lora_rank if mla is not None else 0,
                       qk_rope_head_dim=mla.qk_rope_head_dim if mla is not None else 0)
