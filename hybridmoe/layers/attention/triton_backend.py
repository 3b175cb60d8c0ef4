"""The `triton` attention backend (registered in __init__.py): paged decode (flash-decoding) and paged prefill/extend kernels.

Legend: T new tokens in the batch, B sequences, Hq query heads, Hkv key/value heads, D head dim,
N pages in the pool, S page size.
"""

from __future__ import annotations

import torch

from hybridmoe.layers.attention.base import AttentionBackend, AttentionMetadata, store_kv
from hybridmoe.layers.attention.triton_kernels import paged_decode_attention, paged_prefill_attention


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels over the paged KV cache.

    Decode reads only device tensors of the metadata (seq_lens, block_table) and sizes its grid from
    shapes and meta.max_seq_len, so it is CUDA-graph capturable. Prefill/extend sizes its grid from
    the host list meta.query_lens_cpu, a bound of the device lengths it reads (capturable with a bound).

    Args:
        num_kv_splits: force the decode kernel's KV split count (None: a heuristic from the shapes).
    """

    name = "triton"

    def __init__(self, num_kv_splits: int | None = None) -> None:
        self.num_kv_splits = num_kv_splits

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, S, Hkv, D]
        v_cache: torch.Tensor,  # [N, S, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store k/v of the new tokens at meta.slot_mapping, then attend causally."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            assert q.shape[0] == meta.seq_lens.shape[0], "decode expects one new token per sequence"
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_table,
                meta.seq_lens,
                meta.max_seq_len,
                scale,
                num_splits=self.num_kv_splits,
            )
        max_query_len = max(meta.query_lens_cpu, default=0)
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            max_query_len,
            scale,
        )

    def supports_cuda_graph(self) -> bool:
        return True

    def supports_prefill_cuda_graph(self) -> bool:
        return True  # prefill reads the device metadata; max(query_lens_cpu) bounds its grid
