"""Attention backend interface over the paged KV cache, and the backend registry (its entries are
registered by the package, `layers/attention/__init__.py`, and imported on first use).

Legend: T new tokens in the batch, B sequences, Hq query heads, Hkv key/value heads, D head dim,
N pages in the pool, S page size (tokens per page), P pages per sequence in the block table.

KV cache layout (one layer): k_cache, v_cache: [N, S, Hkv, D]. Token j of a sequence lives in
page block_table[b, j // S] at offset j % S; its flat slot is page * S + offset.

The new tokens of a batch are packed: sequence b owns rows query_start_loc[b]:query_start_loc[b+1]
of q/k/v, and they are the last (query_start_loc[b+1] - query_start_loc[b]) tokens of its
seq_lens[b] tokens (the earlier ones are already in the cache: a cached prefix or earlier chunks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridmoe.registry import Registry


@dataclass
class AttentionMetadata:
    """Everything a backend needs to attend for one forward pass.

    Device tensors are what kernels read (and what CUDA graphs capture); the `*_cpu` lists are
    host copies the scheduler already had, so a backend that loops on the host needs no sync.
    """

    is_decode: bool  # every sequence has exactly one new token
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    block_table: torch.Tensor  # [B, P] int32 page ids (unused entries are 0)
    slot_mapping: torch.Tensor  # [T] int64 flat slot of each new token
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int  # an upper bound of seq_lens (for graph capture: the graph's bound)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def store_kv(
    k: torch.Tensor | None,  # [T, Hkv, D]
    v: torch.Tensor | None,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write the new tokens' keys and values into their cache slots (nothing when k is None: the
    fused q/k/v kernel has stored them)."""
    if k is None or v is None:
        return
    n, s, hkv, d = k_cache.shape
    if is_fp8(k_cache.dtype):
        # fp8 has no index_copy_ on the CPU: copy the bytes. Values beyond the format's range saturate
        # (e5m2 would make them inf), as the GPU's conversion (cvt.satfinite) does in the fused store.
        for x, cache in ((k, k_cache), (v, v_cache)):
            limit = torch.finfo(cache.dtype).max
            codes = x.float().clamp(-limit, limit).to(cache.dtype).view(torch.uint8)
            cache.view(torch.uint8).view(n * s, hkv, d).index_copy_(0, slot_mapping, codes)
        return
    k_cache.view(n * s, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(n * s, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for --kv-cache-dtype `name` (auto: the model's dtype). FP8 caches
    hold K/V unscaled (scale 1, as SGLang without checkpoint scales); kernels upcast on load."""
    if name == "auto":
        return model_dtype
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    if name in FP8_KV_DTYPES:
        return FP8_KV_DTYPES[name]
    raise ValueError(f"--kv-cache-dtype: got {name!r}, expected auto, bf16, fp8_e4m3 or fp8_e5m2")


class AttentionBackend(ABC):
    """Causal attention of the new tokens over their sequences' cached and new tokens."""

    name: str = ""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None: already in the cache (fused_ops.qkv_rope_store)
        v: torch.Tensor | None,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, S, Hkv, D]
        v_cache: torch.Tensor,  # [N, S, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store k/v of the new tokens at meta.slot_mapping (unless None), then attend causally."""

    def supports_cuda_graph(self) -> bool:
        """True when a decode forward reads only device tensors of meta (capturable)."""
        return True

    def supports_prefill_cuda_graph(self) -> bool:
        """True when a forward with new prompt tokens reads only device tensors of meta, the host lists
        bounding its grid at most (engine/prefill_graph.py)."""
        return False


# name -> a zero-argument factory (the backend class); see hybridmoe.registry
ATTENTION_BACKENDS: Registry[Callable[[], AttentionBackend]] = Registry("attention backend")


def register_attention_backend(name: str) -> Callable[[Callable[[], AttentionBackend]], Callable[[], AttentionBackend]]:
    """Decorator registering an attention backend factory (for backends defined outside this package)."""
    return ATTENTION_BACKENDS.decorator(name)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new backend of the registered `name` (UnknownNameError / FactoryLoadError otherwise)."""
    return ATTENTION_BACKENDS.get(name)()
