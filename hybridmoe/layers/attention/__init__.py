"""Attention backends over the paged KV cache (see base.py for the layout)."""

from hybridmoe.layers.attention.base import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
