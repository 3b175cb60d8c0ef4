"""Pure-torch attention over the paged cache: SDPA per sequence for prefill, a batched masked
gather for decode (only device tensors, so decode is capturable in a CUDA graph).

Legend: T new tokens, B sequences, Hq/Hkv heads, G = Hq/Hkv, D head dim, N pages, S page size,
P pages per sequence, L tokens of one sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.layers.attention.base import AttentionBackend, AttentionMetadata, store_kv


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            return _decode(q, k_cache, v_cache, meta, scale)
        return _extend(q, k_cache, v_cache, meta, scale)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    keys = k_cache[meta.block_table].flatten(1, 2)  # [B, P*S, Hkv, D]
    vals = v_cache[meta.block_table].flatten(1, 2)
    qg = q.view(b, hkv, g, d).float()
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys.float()) * scale  # [B, Hkv, G, P*S]
    pos = torch.arange(keys.shape[1], device=q.device)
    valid = pos[None, :] < meta.seq_lens[:, None].long()  # [B, P*S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, vals.float())
    return out.reshape(b, hq, d).to(q.dtype)


# Elements of one masked score block, [Hq, rows, L] in fp32 on the path with an explicit mask (a prompt
# extending a cached prefix, or odd head dims on CUDA): queries go in blocks of rows so that a long
# prompt does not hold its whole [Hq, q_len, L] scores at once (an 8192-token prompt of 32 heads: 8.6 GB,
# twice over for the softmax; the 24 GB CPU-only host was killed). 1 << 26: 256 MiB a block.
MASKED_SCORE_ELEMS = 1 << 26


def _extend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 0:
            continue
        n_pages = -(-seq_len // s)
        pages = meta.block_table[b, :n_pages]
        keys = k_cache[pages].flatten(0, 1)[:seq_len]  # [L, Hkv, D]
        vals = v_cache[pages].flatten(0, 1)[:seq_len]
        qb = q[start:start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        kb = keys.transpose(0, 1).repeat_interleave(g, dim=0).to(qb.dtype)  # [Hq, L, D]
        vb = vals.transpose(0, 1).repeat_interleave(g, dim=0).to(qb.dtype)
        prefix = seq_len - q_len
        plain = qb.is_cuda and (d * qb.element_size()) % 16  # CUDA SDPA kernels need 16-byte aligned rows
        if prefix == 0 and not plain:
            # query i sees keys 0..i: SDPA's own causal mask (memory linear in the length, no mask tensor)
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            ob = torch.empty_like(qb)
            rows = max(1, MASKED_SCORE_ELEMS // (hq * seq_len))
            keys_at = torch.arange(seq_len, device=q.device)[None, :]
            for r0 in range(0, q_len, rows):
                r1 = min(q_len, r0 + rows)
                # query i (absolute position prefix+i) sees keys 0..prefix+i
                mask = keys_at <= prefix + torch.arange(r0, r1, device=q.device)[:, None]  # [rows, L]
                if plain:
                    scores = (qb[:, r0:r1].float() @ kb.float().transpose(1, 2)) * scale
                    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
                    ob[:, r0:r1] = (probs @ vb.float()).to(qb.dtype)
                else:
                    ob[:, r0:r1] = F.scaled_dot_product_attention(qb[:, r0:r1], kb, vb, attn_mask=mask, scale=scale)
        out[start:start + q_len] = ob.transpose(0, 1)
        start += q_len
    return out
