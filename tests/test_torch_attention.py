"""The torch attention backend's prefill/extend (layers/attention/torch_backend.py) against a plain
per-sequence softmax attention, fresh random inputs: sequences with and without a cached prefix, pages
in random order, GQA; the masked path in blocks of query rows (forced small) gives what one block
gives; a long prompt never holds its whole score matrix (no mask for a prompt without a prefix, mask
blocks within the budget otherwise).

Tolerance: fp32 inputs; SDPA's kernels and the reference sum in different orders (~1e-6 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.layers.attention import torch_backend
from hybridmoe.layers.attention.base import AttentionMetadata


def _case(q_lens, prefixes, hq, hkv, d, page, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(q_lens, prefixes)]
    pages_per = [-(-n // page) for n in seq_lens]
    n_pages = sum(pages_per) + 2
    perm = torch.randperm(n_pages, generator=g)
    bt = torch.zeros(len(q_lens), max(pages_per), dtype=torch.int32)
    used = 0
    for i, p in enumerate(pages_per):
        bt[i, :p] = perm[used:used + p]
        used += p
    k_cache = torch.randn(n_pages, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(n_pages, page, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(False, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             bt, torch.zeros(sum(q_lens), dtype=torch.int64), list(q_lens), seq_lens, max(seq_lens))
    return q, k_cache, v_cache, meta


def _reference(q, k_cache, v_cache, meta, scale):
    hq, s, hkv = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    out, start = [], 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slots = [int(meta.block_table[b, i // s]) * s + i % s for i in range(seq_len)]
        k = k_cache.flatten(0, 1)[slots].double()  # [L, Hkv, D]
        v = v_cache.flatten(0, 1)[slots].double()
        for i in range(q_len):
            pos = seq_len - q_len + i
            qi = q[start + i].double().view(hkv, hq // hkv, -1)  # [Hkv, G, D]
            sc = torch.einsum("hgd,lhd->hgl", qi, k[:pos + 1]) * scale
            out.append(torch.einsum("hgl,lhd->hgd", torch.softmax(sc, -1), v[:pos + 1]).reshape(hq, -1))
        start += q_len
    return torch.stack(out)


CASES = [  # q_lens, prefixes, Hq, Hkv, D, page
    ([7], [0], 4, 2, 16, 4),
    ([5, 9, 1], [0, 13, 30], 6, 2, 8, 8),
    ([33], [17], 8, 1, 32, 16),
    ([12, 3], [0, 0], 3, 3, 10, 4),
]


@pytest.mark.parametrize("elems", [None, 1])
@pytest.mark.parametrize("q_lens,prefixes,hq,hkv,d,page", CASES)
def test_extend_matches_reference(q_lens, prefixes, hq, hkv, d, page, elems, monkeypatch):
    """elems 1: the masked path one query row a block."""
    if elems is not None:
        monkeypatch.setattr(torch_backend, "MASKED_SCORE_ELEMS", elems)
    q, kc, vc, meta = _case(q_lens, prefixes, hq, hkv, d, page, seed=sum(q_lens) * 31 + hq)
    scale = d ** -0.5
    got = torch_backend._extend(q, kc, vc, meta, scale)
    ref = _reference(q, kc, vc, meta, scale)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_long_prompt_never_holds_its_whole_score_matrix(monkeypatch):
    """A prompt without a prefix takes SDPA's causal mask (no mask tensor); one extending a prefix goes in
    blocks of query rows whose scores stay within MASKED_SCORE_ELEMS."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None):
        calls.append((tuple(q.shape), None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch_backend, "MASKED_SCORE_ELEMS", 4 * 300 * 50)  # Hq 4, 300 keys: 50 rows a block
    q, kc, vc, meta = _case([260, 200], [0, 100], 4, 2, 8, 16, seed=5, dtype=torch.bfloat16)
    torch_backend._extend(q, kc, vc, meta, 8 ** -0.5)
    assert calls[0] == ((4, 260, 8), None, True)
    masked = calls[1:]
    assert len(masked) == 4 and all(m[2] is False and m[1][1] == 300 and m[1][0] <= 50 for m in masked), masked
    assert sum(m[1][0] for m in masked) == 200
