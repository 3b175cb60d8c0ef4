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
    # The rows past a sequence's end are another request's leftovers (freed pages are not cleared): a
    # probability of 0 times a NaN or inf left there is NaN, so they are zeroed, not just weighted 0.
    vals = vals.float().masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("bhgl,blhd->bhgd", probs, vals)
    return out.reshape(b, hq, d).to(q.dtype)


# Elements of one score block of the plain path (odd head dims on CUDA): [Hq, rows, L] in fp32, queries
# in blocks of rows so that a long prompt never holds its whole [Hq, q_len, L] scores (an 8192-token
# prompt of 32 heads: 8.6 GB, twice over for the softmax). 1 << 26: 256 MiB a block.
PLAIN_SCORE_ELEMS = 1 << 26


def _plain(qb, kb, vb, prefix: int, scale: float) -> torch.Tensor:
    """Softmax attention of qb [Hq, q, D] over kb, vb [Hq, L, D] in fp32 matmuls, query i (absolute
    position prefix + i) seeing keys 0..prefix+i, in blocks of query rows."""
    hq, q_len, seq_len = qb.shape[0], qb.shape[1], kb.shape[1]
    ob = torch.empty_like(qb)
    rows = max(1, PLAIN_SCORE_ELEMS // (hq * seq_len))
    keys_at = torch.arange(seq_len, device=qb.device)[None, :]
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        mask = keys_at <= prefix + torch.arange(r0, r1, device=qb.device)[:, None]  # [rows, L]
        scores = (qb[:, r0:r1].float() @ kb.float().transpose(1, 2)) * scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        ob[:, r0:r1] = (probs @ vb.float()).to(qb.dtype)
    return ob


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
        if qb.is_cuda and (d * qb.element_size()) % 16:
            # CUDA SDPA kernels need 16-byte aligned rows; odd head dims take the plain path.
            ob = _plain(qb, kb, vb, prefix, scale)
        else:
            # 4-D [1, Hq, T, D]: on the CPU only 4-D inputs reach SDPA's flash kernel (memory linear in the
            # length); 3-D ones took the math path, [Hq, T, L] scores in fp32: an 8192-token CPU-only prompt
            # was OOM-killed at 24 GB. No prefix: SDPA's own causal mask (no mask tensor, half the work).
            # In fp32 for half types: the CPU flash kernel rounds the probabilities to the half type (~20%
            # more error than the math path at bf16); in fp32 it rounds once at the end as the math path did
            # (bit-equal at 12 tokens) and runs as fast (4096 tokens, 32 heads: 0.97 s against 1.05 s). On
            # CUDA the same keeps this backend, the tests' reference, at the math path's accuracy (fp32 should
            # take the memory-efficient kernel there; not yet run on a GPU).
            wide = qb.dtype in (torch.bfloat16, torch.float16)
            q4, k4, v4 = (x.unsqueeze(0).float() if wide else x.unsqueeze(0) for x in (qb, kb, vb))
            if prefix == 0:
                ob = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)[0]
            else:
                # query i (absolute position prefix+i) sees keys 0..prefix+i
                mask = torch.arange(seq_len, device=q.device)[None, :] <= (
                    prefix + torch.arange(q_len, device=q.device)[:, None])
                ob = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)[0]
            ob = ob.to(qb.dtype)
        out[start:start + q_len] = ob.transpose(0, 1)
        start += q_len
    return out
