"""Attention backends over the paged KV cache (see base.py for the layout).

The built-in backends are registered here by name and imported on first use, so the interface
(base.py) imports none of them and a missing Triton makes only the "triton" backend unavailable.
"""

from hybridmoe.layers.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
)

ATTENTION_BACKENDS.register("torch", "hybridmoe.layers.attention.torch_backend:TorchAttentionBackend")
ATTENTION_BACKENDS.register("triton", "hybridmoe.layers.attention.triton_backend:TritonAttentionBackend")

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
