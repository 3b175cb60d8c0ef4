"""The native CPU decode attention (hybridmoe.cpu.attn_decode, csrc/attn_decode.cpp) against the
layer's own torch path (q/k norm + RoPE reference, store_kv, the torch backend's decode), with
fresh random inputs: GQA ratios 1 and > 1, with and without q/k norm and qkv bias, odd head dims,
sequences of 1 token, of a partly filled last page and of many pages, pages in random order; both span
kernels (G < 4: each kv head in turn; 4 <= G <= 16: heads in lanes, one and two lane vectors).

Tolerance, justified: the new k (normed, rotated) and v are the same bf16 values as torch's up to
the norm's sum order (its rsqrt may round differently: at most one bf16 ulp on a few values); the
attention output is fp32 math on those, rounded to bf16, so it agrees within ~2 bf16 ulps (2^-7
relative) of the output's scale, and a wrong page, position, head mapping or softmax moves it by
O(1) of that scale.
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe.cpu.attn_decode import AttnDecodeLayers
from hybridmoe.layers.attention.base import AttentionMetadata, get_attention_backend
from hybridmoe.layers.attention.layer import Attention, ForwardContext
from hybridmoe.layers.rotary import RotaryEmbedding


def _setup(hq, hkv, d, qk_norm, bias, lens, page, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = 48
    rope = RotaryEmbedding(d, 2048, 10000.0)
    attn = Attention(0, hidden, hq, hkv, d, rope, qkv_bias=bias, qk_norm=qk_norm).bfloat16()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 and
                                                                                           qk_norm else 0.0))
    b = len(lens)
    pages_per = [-(-n // page) for n in lens]
    n_pages = sum(pages_per) + 3
    perm = torch.randperm(n_pages, generator=g)
    bt = torch.zeros(b, max(pages_per), dtype=torch.int32)
    used = 0
    for i, p in enumerate(pages_per):
        bt[i, :p] = perm[used:used + p]
        used += p
    k_cache = torch.randn(n_pages, page, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(n_pages, page, hkv, d, generator=g).bfloat16()
    pos = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(bt[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(lens)])
    meta = AttentionMetadata(True, torch.arange(b + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), bt,
                             slots, [1] * b, list(lens), max(lens))
    x = torch.randn(b, hidden, generator=g).bfloat16()
    return attn, k_cache, v_cache, meta, x, pos


CASES = [  # Hq, Hkv, D, qk_norm, bias, seq lens, page size
    (4, 2, 16, True, False, [1, 17, 40], 16),
    (6, 2, 30, True, True, [5], 4),
    (3, 3, 8, False, True, [33, 2], 8),
    (8, 1, 64, True, False, [100, 1, 64], 16),
    # long sequences: on a pool, spans of positions merged by their softmax states (attn_pool.cpp)
    (16, 2, 64, True, False, [1100, 3], 16),
    (5, 1, 20, False, True, [700], 8),  # 5 heads a group, D % 8 = 4
    (12, 1, 8, True, False, [530, 260], 4),  # 12 heads a group: two lane vectors (span_lanes<2>)
    # heads in lanes (4 <= G <= 16), every kv head of a span in turn: 16 and 4 heads a group, D % 16 == 0
    # (the vectorized q/k norm and RoPE), positions in blocks of 32 with tails
    (64, 4, 32, True, False, [300, 2, 77], 16),
    (8, 2, 48, False, True, [129, 33], 8),
    # the AVX-512 span: two lane vectors (17..32 heads a group), and more heads than it takes (the AVX2 span)
    (48, 2, 16, True, False, [90, 5], 8),
    (32, 1, 34, False, True, [260], 16),
    (40, 1, 16, True, False, [70], 8),
]

KERNELS = ["avx2", "avx512"]


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Each span kernel in turn (the AVX-512 one skipped where the CPU lacks it), restored after."""
    from hybridmoe.cpu import attn_decode

    if not attn_decode.kernel_available(request.param):
        pytest.skip(f"the {request.param} decode attention kernel cannot run here")
    prev = attn_decode.set_kernel(request.param)
    yield request.param
    attn_decode.set_kernel(prev)


@pytest.mark.parametrize("threads", [None, 2, 3])
@pytest.mark.parametrize("hq,hkv,d,qk_norm,bias,lens,page", CASES)
def test_matches_torch_path(hq, hkv, d, qk_norm, bias, lens, page, threads, kernel):
    """On the calling thread (threads None) and spread over a pool's threads (units, spans)."""
    from hybridmoe.cpu.engine import CPUThreadPool

    attn, kc, vc, meta, x, pos = _setup(hq, hkv, d, qk_norm, bias, lens, page, seed=hq * 100 + d)
    attn.o_proj = torch.nn.Identity()  # compare the attention output itself, not its projection
    backend = get_attention_backend("torch")
    ad = AttnDecodeLayers(attn)
    if threads:
        ad.pool = CPUThreadPool(threads)
    assert ad.modules == {"": attn}
    caches = {}
    outs = {}
    with torch.no_grad():
        for on in (False, True):
            ad.enabled = on
            k, v = kc.clone(), vc.clone()
            outs[on] = attn(x, pos, ForwardContext(meta, [(k, v)], backend))
            caches[on] = (k, v)
    assert ad.native_calls == 1
    assert torch.equal(caches[True][1], caches[False][1])  # v stored as is
    kt, kn = caches[False][0].float(), caches[True][0].float()
    assert ((kt - kn).abs() <= kt.abs() * 2**-7).all()  # k: at most one bf16 ulp apart
    ref, got = outs[False].float(), outs[True].float()
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= scale * 2**-7, ((got - ref).abs().max(), scale)


def test_prefill_runs_the_torch_forward_and_remove_restores_it():
    """A non-decode batch takes the layer's own forward, bit for bit; remove() puts it back."""
    attn, kc, vc, meta, x, pos = _setup(4, 2, 16, True, False, [3], 4, seed=1)
    backend = get_attention_backend("torch")
    pre = AttentionMetadata(False, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping, [1], [3],
                            3)
    ad = AttnDecodeLayers(attn)
    with torch.no_grad():
        ours = attn(x, pos, ForwardContext(pre, [(kc.clone(), vc.clone())], backend))
        assert ad.native_calls == 0
        ad.remove()
        assert "forward" not in vars(attn)
        ref = attn(x, pos, ForwardContext(pre, [(kc.clone(), vc.clone())], backend))
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("rows,h", [(1, 2048), (1, 1), (3, 72), (4, 33), (2, 4099)])
def test_add_norm_matches_reference(rows, h):
    """Residual RMSNorm: the new residual is bit-identical (one bf16 add); the normed output within
    one bf16 ulp (the mean's fp32 sum order may differ from torch's, moving a rounding)."""
    from hybridmoe.layers.fused_ops import add_rmsnorm_ref
    from hybridmoe.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(rows * 10000 + h)
    norm = RMSNorm(h, 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h, generator=g) + 0.5)
    ad = AttnDecodeLayers(norm)
    assert ad.norms == {"": norm}
    x = (torch.randn(rows, h, generator=g) * 3).bfloat16()
    res = torch.randn(rows, h, generator=g).bfloat16()
    out, new_res = norm.add_norm(x, res)
    assert ad.native_calls == 1
    ref, ref_res = add_rmsnorm_ref(x, res, norm.weight, 1e-6)
    assert torch.equal(new_res, ref_res)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()
    big = torch.randn(5, h, generator=g).bfloat16()  # over MAX_NORM_ROWS: the torch ops, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(norm.add_norm(big, big), add_rmsnorm_ref(big, big, norm.weight, 1e-6)))
    assert ad.native_calls == 1
    # forward (no residual): the same, natively up to MAX_NORM_ROWS rows
    ref1, _ = add_rmsnorm_ref(x, None, norm.weight, 1e-6)
    got1 = norm(x)
    assert ad.native_calls == 2
    assert ((got1.float() - ref1.float()).abs() <= ref1.float().abs() * 2**-7).all()
    assert torch.equal(norm(big), add_rmsnorm_ref(big, None, norm.weight, 1e-6)[0])
    assert ad.native_calls == 2
    ad.remove()
    assert "forward" not in vars(norm) and "add_norm" not in vars(norm)
