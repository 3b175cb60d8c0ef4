"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) over a paged latent KV cache.

Legend: T new tokens, B sequences, H heads, Dn qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim,
Lkv kv_lora_rank, Lq q_lora_rank, N pages, S page size, P pages per sequence, L tokens of a sequence.

Per token the cache holds one entry [c_kv (Lkv) | k_pe (R)] shared by all heads, at the slot the
standard cache uses (page block_table[b, j // S], offset j % S; page 0 is scratch): c_kv = kv_a_layernorm of the compressed kv, k_pe the rope key
after the rotary embedding. kv_b_proj expands c_kv to each head's K_nope [Dn] and V [Dv]:
W_kv_b viewed [H, Dn + Dv, Lkv] = [W_UK | W_UV].

- Decode (one new token per sequence): the weight-absorbed form, attention in the latent space:
  q_lat = q_nope W_UK [B, H, Lkv], scores q_lat . c_kv + q_pe . k_pe, o_lat = softmax . c_kv,
  out = o_lat W_UV^T. Reads only device tensors of the metadata (CUDA-graph capturable); the
  Triton kernel of mla_triton.py with the triton backend on CUDA, mla_ref.mla_decode_ref otherwise.
- Prefill / extend over a cached prefix (chunked prefill, prefix-cache hits), in one of two forms:
  expanded: each sequence's latents are gathered from its pages and expanded with kv_b_proj, then
  causal SDPA; absorbed: every new token is a decode query of its own over its causal prefix (a
  virtual sequence of length prefix + i + 1 on its sequence's block table) through the decode path.
  The expanded form pays kv_b_proj over every cached token (2 Lkv H (Dn + Dv) FLOP each) and
  2 H (Dn + R + Dv) per query-key pair, the absorbed one 2 H (2 Lkv + R) per pair: for DeepSeek-V3
  the absorbed form does fewer FLOPs when a sequence adds fewer than ~170 tokens to its prefix
  (short prompts, small chunks, big prefix-cache hits). `_extend_form` compares the two costs, the
  absorbed one weighted by ABSORBED_FLOP_COST (the decode kernel's FLOP rate is lower than cuBLAS's and
  the flash kernel's: benchmarks/bench_mla_extend.py measures both forms).

RoPE: DeepSeek checkpoints rotate interleaved channel pairs (x0, x1), (x2, x3), ...
(`rope_interleave`, always for V2); the rope channels are de-interleaved to [evens | odds] and
rotated in the rotate-half layout, which is transformers' V3 interleaved formula exactly and a
fixed permutation of V2's complex one (q and k permuted alike: the same scores).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.layers.attention.mla_ref import mla_decode_ref
from hybridmoe.layers.fused_ops import qk_norm_rope
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from hybridmoe.layers.attention.base import AttentionMetadata
    from hybridmoe.layers.attention.layer import ForwardContext

log = logging.getLogger(__name__)

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the reference builds them with the default eps
# Cost of an absorbed-form FLOP in expanded-form FLOPs (`_extend_form`). Measured on the H200 (bf16, H 128,
# benchmarks/bench_mla_extend.py, 16 cases of prefix 0-16K x 1-4096 new tokens): 1.02-1.53 wherever either
# form runs long enough to be compute-bound (more at a few queries, where the absorbed form is
# latency-bound but fast anyway); with 1.3 the model picks the faster form in 14 of the 16 cases (the two
# misses: prompts of 64 and 256 tokens with no prefix, 0.63 vs 0.74 ms and 0.40 vs 0.46 ms, both
# dominated by launches).
ABSORBED_FLOP_COST = 1.3
# Without the Triton kernel (CPU, other backends) the absorbed form runs mla_decode_ref, which gathers
# [T, P * S, Lkv + R] fp32 rows: taken only while that stays this small.
REF_GATHER_LIMIT_BYTES = 64 << 20


@dataclass(frozen=True)
class MLAConfig:
    """The shapes of a model's MLA (its config's fields of the same names)."""

    q_lora_rank: int | None  # None or 0: q_proj instead of q_a_proj / q_a_layernorm / q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved_rope: bool = True  # rope channels as interleaved pairs (rope_interleave; always for V2)
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj have a bias

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Cache elements per token and layer: Lkv + R."""
        return self.kv_lora_rank + self.qk_rope_head_dim


_kernel_missing_logged = False


def _decode_kernel(ctx: ForwardContext, like: torch.Tensor):
    """mla_decode of mla_triton.py on CUDA with the triton backend, else the torch reference."""
    global _kernel_missing_logged
    if like.is_cuda and ctx.backend.name == "triton":
        try:
            from hybridmoe.layers.attention.mla_triton import mla_decode

            return mla_decode
        except ImportError as e:
            if not _kernel_missing_logged:
                log.warning("MLA decode: the Triton kernel is unavailable (%s); using the torch reference", e)
                _kernel_missing_logged = True
    return mla_decode_ref


def deinterleave(x: torch.Tensor) -> torch.Tensor:  # [..., R] (x0, x1, x2, ...) -> [..., R] (x0, x2, ... | x1, x3, ...)
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAAttention(nn.Module):
    """The attention block of a DeepSeek decoder layer; parameter names are the checkpoint's.

    Args: rotary: the rope table (qk_rope_head_dim channels); softmax_scale: (Dn + R)^-0.5 times
    YaRN's mscale^2 (RopeParams.softmax_mscale)."""

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, mla: MLAConfig, rotary: RotaryEmbedding,
                 softmax_scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_lora_rank = num_heads, mla.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.q_lora_rank = mla.q_lora_rank
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=mla.bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, num_heads * mla.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, num_heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.cache_width, bias=mla.bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * self.v_dim, hidden, bias=mla.bias)
        self.rotary = [rotary]  # shared table; a list keeps it out of this module's state_dict
        self.interleaved_rope = mla.interleaved_rope
        self.scale = softmax_scale
        self.extend_form: str | None = None  # "absorbed" / "expanded" forces a form (tests, benchmarks)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, n, R] -> [T, n, R]
        if self.interleaved_rope:
            x = deinterleave(x)
        rope = self.rotary[0]
        return qk_norm_rope(x.contiguous(), None, 0.0, rope.cos, rope.sin, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, lkv = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(t, h, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope_dim], self._rope(q[..., self.nope_dim:], positions)  # [T, H, Dn], [T, H, R]
        ckv = self.kv_a_proj_with_mqa(x)  # [T, Lkv + R]
        c_kv = self.kv_a_layernorm(ckv[:, :lkv])  # [T, Lkv]
        k_pe = self._rope(ckv[:, None, lkv:], positions)[:, 0]  # [T, R]
        (cache,) = ctx.kv_caches[self.layer_idx]  # [N, S, Lkv + R]
        meta = ctx.attn_meta
        n, s, width = cache.shape
        cache.view(n * s, width).index_copy_(0, meta.slot_mapping, torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype))
        if meta.is_decode:
            o = self._absorbed(q_nope, q_pe, cache, meta.block_table, meta.seq_lens, meta.max_seq_len, ctx)
        elif self._extend_form(meta, cache, ctx) == "absorbed":
            o = self._extend_absorbed(q_nope, q_pe, cache, meta, ctx)
        else:
            o = self._extend(q_nope, q_pe, cache, meta)
        return self.o_proj(o.reshape(t, h * self.v_dim))

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:  # W_UK [H, Dn, Lkv], W_UV [H, Dv, Lkv] (views)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _absorbed(self, q_nope, q_pe, cache, block_table, seq_lens, max_seq_len: int,
                  ctx: ForwardContext) -> torch.Tensor:  # [B, H, Dv]: one query a (virtual) sequence
        w_uk, w_uv = self._w_kv_b()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, Lkv]
        kernel = _decode_kernel(ctx, q_lat)
        # max_seq_len: a static bound (a graph's: the context length) the kernel picks its KV split count from
        o_lat = kernel(q_lat.contiguous(), q_pe.contiguous(), cache, block_table, seq_lens, self.scale,
                       max_seq_len=max_seq_len)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, Dv]

    def _extend_form(self, meta: AttentionMetadata, cache: torch.Tensor, ctx: ForwardContext) -> str:
        """"absorbed" or "expanded" for this batch: the form of fewer modeled FLOPs (module docstring),
        host lengths only."""
        if self.extend_form is not None:
            return self.extend_form
        h, lkv, dn, r, dv = self.num_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim
        pairs = sum(q * n for q, n in zip(meta.query_lens_cpu, meta.seq_lens_cpu))
        expanded = sum(meta.seq_lens_cpu) * 2 * lkv * h * (dn + dv) + pairs * 2 * h * (dn + r + dv)
        absorbed = pairs * 2 * h * (2 * lkv + r) + sum(meta.query_lens_cpu) * 2 * h * lkv * (dn + dv)
        if absorbed * ABSORBED_FLOP_COST >= expanded:
            return "expanded"
        if _decode_kernel(ctx, cache) is mla_decode_ref:  # the torch path gathers every row per query
            gather = sum(meta.query_lens_cpu) * meta.block_table.shape[1] * cache.shape[1] * cache.shape[2] * 4
            if gather > REF_GATHER_LIMIT_BYTES:
                return "expanded"
        return "absorbed"

    def _extend_absorbed(self, q_nope, q_pe, cache, meta: AttentionMetadata,
                         ctx: ForwardContext) -> torch.Tensor:  # [T, H, Dv]
        """Every new token a decode query over its causal prefix: token i of sequence b (whose first
        seq_len - q_len tokens are cached) attends to the first seq_len - q_len + i + 1 tokens."""
        owner: list[int] = []
        lens: list[int] = []
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            owner += [b] * q_len
            lens += range(seq_len - q_len + 1, seq_len + 1)
        dev = q_nope.device
        table = meta.block_table[torch.tensor(owner, dtype=torch.long, device=dev)]  # [T, P]
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)  # [T]
        return self._absorbed(q_nope, q_pe, cache, table, seq_lens, max(lens, default=1), ctx)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              prefix: int) -> torch.Tensor:  # q [H, Q, Dk], k [H, L, Dk], v [H, L, Dv] -> [H, Q, Dv]
        """Causal attention of one sequence's queries over its keys through torch's fused kernels: 4-D
        inputs (3-D ones fall back to the math kernel, which upcasts to fp32 and materialises [H, Q, L]
        scores: 34 GB for 8192 tokens and 128 heads). Without a cached prefix, V zero-padded to the q/k
        head dim and is_causal, so the flash kernel is eligible (it wants one head dim); with a prefix
        the mask (is_causal aligns the diagonal top-left, not to the prefix) and the memory-efficient one."""
        q4, k4 = q.unsqueeze(0), k.unsqueeze(0)
        dk, dv = q.shape[-1], v.shape[-1]
        if prefix == 0 and q.is_cuda and dv < dk:
            v4 = F.pad(v, (0, dk - dv)).unsqueeze(0)
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale)[0, ..., :dv]
        if prefix == 0:
            return F.scaled_dot_product_attention(q4, k4, v.unsqueeze(0), is_causal=True, scale=self.scale)[0]
        return F.scaled_dot_product_attention(q4, k4, v.unsqueeze(0), attn_mask=mask[None, None], scale=self.scale)[0]

    def _extend(self, q_nope, q_pe, cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H, Dv]
        h, dn, lkv = self.num_heads, self.nope_dim, self.kv_lora_rank
        s = cache.shape[1]
        q_all = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, Dn + R]
        out = q_nope.new_empty(q_nope.shape[0], h, self.v_dim)
        start = 0
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 0:
                continue
            pages = meta.block_table[b, :-(-seq_len // s)]
            ent = cache[pages].flatten(0, 1)[:seq_len]  # [L, Lkv + R]
            kv = self.kv_b_proj(ent[:, :lkv].to(q_nope.dtype)).view(seq_len, h, dn + self.v_dim)
            k = torch.cat([kv[..., :dn], ent[:, None, lkv:].to(kv.dtype).expand(seq_len, h, self.rope_dim)], -1)
            qb = q_all[start:start + q_len].transpose(0, 1)  # [H, q_len, Dn + R]
            kb, vb = k.transpose(0, 1), kv[..., dn:].transpose(0, 1)  # [H, L, Dn + R], [H, L, Dv]
            prefix = seq_len - q_len  # query i (position prefix + i) sees keys 0..prefix + i
            mask = torch.arange(seq_len, device=q_nope.device)[None, :] <= (
                prefix + torch.arange(q_len, device=q_nope.device)[:, None])
            if qb.is_cuda and any((d * qb.element_size()) % 16 for d in (qb.shape[-1], vb.shape[-1])):
                # CUDA SDPA kernels need 16-byte aligned rows; odd head dims take the plain path
                scores = (qb.float() @ kb.float().transpose(1, 2)) * self.scale
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
                ob = (probs @ vb.float()).to(qb.dtype)
            else:
                ob = self._sdpa(qb, kb, vb, mask, prefix)
            out[start:start + q_len] = ob.transpose(0, 1)
            start += q_len
        return out
