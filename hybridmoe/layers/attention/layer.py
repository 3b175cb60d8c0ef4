"""The attention block of a decoder layer: q/k/v projections, optional per-head q/k RMSNorm,
RoPE, the paged attention backend, and the output projection.

Legend: T tokens, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridmoe.layers.attention.base import AttentionBackend, AttentionMetadata
from hybridmoe.layers.fused_ops import qk_norm_rope, qkv_rope_store, use_triton
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import RotaryEmbedding


@dataclass
class ForwardContext:
    """What every layer needs for one forward pass besides its input."""

    attn_meta: AttentionMetadata
    # per layer: (k_cache, v_cache) [N, S, Hkv, D]; MLA (attention/mla.py): (latent cache,) [N, S, Lkv + R]
    kv_caches: list[tuple[torch.Tensor, ...]]
    backend: AttentionBackend


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        rms_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # q, k and v in one GEMM (one launch instead of three per layer in decode); the loader fills
        # its row blocks from the checkpoint's q_proj, k_proj and v_proj (see checkpoint_parts)
        self.qkv_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        self.qkv_proj = nn.Linear(hidden, sum(self.qkv_sizes), bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_eps)
            self.k_norm = RMSNorm(head_dim, rms_eps)
        self.qk_norm = qk_norm
        self.rms_eps = rms_eps
        self.rotary = [rotary]  # shared table; a list keeps it out of this module's state_dict
        self.scale = head_dim**-0.5

    def checkpoint_parts(self, prefix: str, suffix: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint tensor name, the slice of `param` it fills) for the fused qkv_proj.<suffix>."""
        views = param.split(self.qkv_sizes, dim=0)
        return [(f"{prefix}.{p}.{suffix}", v) for p, v in zip(("q_proj", "k_proj", "v_proj"), views)]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        rope = self.rotary[0]
        if use_triton(qkv):  # norm + RoPE of q and k and the KV store in one launch (decode is launch-bound)
            q = qkv_rope_store(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight if self.qk_norm else None,
                               self.k_norm.weight if self.qk_norm else None, self.rms_eps, rope.cos, rope.sin,
                               positions, k_cache, v_cache, ctx.attn_meta.slot_mapping)
            if q is not None:  # None: the fused kernel cannot be built here; the separate kernels below
                o = ctx.backend.forward(q, None, None, k_cache, v_cache, ctx.attn_meta, self.scale)  # [T, Hq, D]
                return self.o_proj(o.reshape(t, -1))
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q = qk_norm_rope(q, self.q_norm.weight if self.qk_norm else None, self.rms_eps, rope.cos, rope.sin, positions)
        k = qk_norm_rope(k, self.k_norm.weight if self.qk_norm else None, self.rms_eps, rope.cos, rope.sin, positions)
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.attn_meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, -1))
