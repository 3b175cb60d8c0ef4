"""The torch attention backend's prefill/extend (layers/attention/torch_backend.py) against a plain
per-sequence softmax attention, fresh random inputs: sequences with and without a cached prefix, pages
in random order, GQA; the plain path (odd head dims on CUDA) in blocks of query rows, down to one row,
on the same cases; SDPA gets 4-D inputs (on the CPU only those reach its flash kernel: 3-D ones took
the math path, whose [Hq, T, T] fp32 scores OOM-killed an 8192-token prompt) and, without a prefix,
its own causal mask.

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


@pytest.mark.parametrize("q_lens,prefixes,hq,hkv,d,page", CASES)
def test_extend_matches_reference(q_lens, prefixes, hq, hkv, d, page):
    q, kc, vc, meta = _case(q_lens, prefixes, hq, hkv, d, page, seed=sum(q_lens) * 31 + hq)
    scale = d ** -0.5
    got = torch_backend._extend(q, kc, vc, meta, scale)
    ref = _reference(q, kc, vc, meta, scale)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("leftover", ["nan", "inf", "-inf"])
def test_decode_ignores_leftovers_past_the_sequence_end(leftover):
    """Decode over pages whose slots past each sequence's end (and the unused pages and block-table
    padding) hold another request's non-finite leftovers: the same answer as the reference, finite.
    Before the values were zeroed there, 0 * NaN made the whole output NaN."""
    prefixes, page = [0, 6, 13, 3], 4
    q, kc, vc, meta = _case([1] * len(prefixes), prefixes, 6, 2, 8, page, seed=11)
    bad = float(leftover)
    live = torch.zeros(kc.shape[0] * page, dtype=torch.bool)
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        live[[int(meta.block_table[b, i // page]) * page + i % page for i in range(seq_len)]] = True
    kc.flatten(0, 1)[~live] = bad
    vc.flatten(0, 1)[~live] = bad
    meta.block_table = torch.cat([meta.block_table, meta.block_table[:, :1]], dim=1)  # a padded column
    got = torch_backend._decode(q, kc, vc, meta, 8 ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _reference(q, kc, vc, meta, 8 ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("elems", [None, 1, 7 * 40])
@pytest.mark.parametrize("q_lens,prefixes,hq,hkv,d,page", CASES)
def test_plain_path_in_row_blocks(q_lens, prefixes, hq, hkv, d, page, elems, monkeypatch):
    """The plain path (_plain, taken for odd head dims on CUDA) on the CPU: one block, one row a block, a few."""
    if elems is not None:
        monkeypatch.setattr(torch_backend, "PLAIN_SCORE_ELEMS", elems)
    q, kc, vc, meta = _case(q_lens, prefixes, hq, hkv, d, page, seed=sum(q_lens) * 31 + hq)
    scale = d ** -0.5
    ref = _reference(q, kc, vc, meta, scale)
    s, start = kc.shape[1], 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slots = [int(meta.block_table[b, i // s]) * s + i % s for i in range(seq_len)]
        kb = kc.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        vb = vc.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        got = torch_backend._plain(q[start:start + q_len].transpose(0, 1), kb, vb, seq_len - q_len, scale)
        torch.testing.assert_close(got.transpose(0, 1).double(), ref[start:start + q_len], rtol=1e-5, atol=1e-5)
        start += q_len


def test_sdpa_gets_4d_inputs_and_its_causal_mask(monkeypatch):
    """A prompt without a prefix takes SDPA's causal mask (no mask tensor); one extending a prefix its
    explicit mask; both 4-D."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None):
        calls.append((tuple(q.shape), None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", spy)
    q, kc, vc, meta = _case([260, 200], [0, 100], 4, 2, 8, 16, seed=5, dtype=torch.bfloat16)
    torch_backend._extend(q, kc, vc, meta, 8 ** -0.5)
    assert calls == [((1, 4, 260, 8), None, True), ((1, 4, 200, 8), (200, 300), False)]


def test_long_prompt_prefill_memory_is_linear():
    """A 4096-token bf16 prompt of 32 heads (in a subprocess: its peak RSS) adds well under the 2 GB its
    [Hq, T, T] fp32 scores would take (the math path took ~5 GB)."""
    import subprocess
    import sys

    code = """
import resource, torch
from hybridmoe.layers.attention import torch_backend
from hybridmoe.layers.attention.base import AttentionMetadata
T, hq, hkv, d, page = 4096, 32, 4, 128, 16
kc = torch.randn(T // page, page, hkv, d).bfloat16(); vc = torch.randn(T // page, page, hkv, d).bfloat16()
q = torch.randn(T, hq, d).bfloat16()
meta = AttentionMetadata(False, torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                         torch.arange(T // page, dtype=torch.int32)[None], torch.zeros(T, dtype=torch.int64), [T], [T], T)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.inference_mode():
    torch_backend._extend(q, kc, vc, meta, d ** -0.5)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) * 1024)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout.strip().splitlines()[-1]) < 512 << 20, res.stdout


def test_bf16_prefill_as_accurate_as_the_math_path():
    """bf16 on the CPU: the flash kernel in fp32 (the backend's choice) against a float64 reference is no less
    accurate than SDPA's math path (what 3-D inputs got before); the bf16 flash kernel was ~20% worse, enough to
    move a top-1 choice of test_fp8_weights' chaotic nets."""
    q, kc, vc, meta = _case([300, 40], [0, 25], 8, 2, 32, 16, seed=11, dtype=torch.bfloat16)
    scale = 32 ** -0.5
    ref = _reference(q, kc, vc, meta, scale)
    got = torch_backend._extend(q, kc, vc, meta, scale)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    # the math path on the first sequence (no prefix) and the second (prefix 25), 3-D with an explicit mask
    s, start, outs = kc.shape[1], 0, []
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        slots = [int(meta.block_table[b, i // s]) * s + i % s for i in range(seq_len)]
        kb = kc.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(4, dim=0)
        vb = vc.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(4, dim=0)
        mask = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len)[:, None])
        qb = q[start:start + q_len].transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale).transpose(0, 1))
        start += q_len
    math_err = ((torch.cat(outs).double() - ref).norm() / ref.norm()).item()
    assert err <= 1.05 * math_err, (err, math_err)
