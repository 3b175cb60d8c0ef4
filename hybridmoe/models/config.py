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
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelConfig(hf=hf_config, spec=spec, source=source, num_layers=hf_config.num_hidden_layers,
                       hidden_size=hf_config.hidden_size, vocab_size=hf_config.vocab_size, num_heads=heads,
                       num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                       max_position=getattr(hf_config, "max_position_embeddings", None) or 4096,
                       kv_lora_rank=int(getattr(hf_config, "kv_lora_rank", None) or 0),
                       qk_rope_head_dim=int(getattr(hf_config, "qk_rope_head_dim", None) or 0))
