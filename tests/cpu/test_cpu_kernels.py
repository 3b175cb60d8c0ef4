"""The native kernels against the pure-torch reference, on every ISA path this machine has.

Two bounds per method (Frobenius-relative error, and max error relative to max |ref|):
  * kernel vs oracle (the reference with the method's dequantized weights and the kernels'
    activation rounding: int8 per row for AMXINT8/AMXINT4, bf16 on the AVX-512/AMX BF16 path):
    the difference is summation order and an occasional 1-LSB flip of a quantized activation:
    rel <= 2e-3, max <= 2e-2 for every method.
  * kernel vs the unquantized float reference (what quantization costs, random Gaussian weights):
    AMXINT8 rel <= 0.04; AMXINT4 rel <= 0.30 (G=32..128, sym/asym); BF16 rel <= 0.01; FP8 rel <= 0.08
    (e4m3 keeps 3 mantissa bits: ~2.6% per matrix on Gaussian weights, measured ~0.05 end to end).
FP8's own edge cases (every e4m3 code, block shapes, resident bytes): test_cpu_fp8.py.
"""

import functools

import pytest
import torch

from hybridmoe.cpu.engine import CPUMoELayer
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.cpu.reference import max_error, moe_reference, rel_error

ORACLE_REL, ORACLE_MAX = 2e-3, 2e-2
FP_REL = {"AMXINT8": 0.04, "AMXINT4": 0.30, "BF16": 0.01, "FP8": 0.08}
# FP8 from float weights: block-quantized in group x group blocks (32: several blocks per matrix)
METHODS = [("AMXINT8", 128, True), ("AMXINT4", 32, True), ("AMXINT4", 128, False), ("BF16", 128, True),
           ("FP8", 128, True), ("FP8", 32, True)]
METHOD_IDS = ["int8", "int4g32", "int4g128a", "bf16", "fp8b128", "fp8b32"]


@functools.lru_cache(maxsize=32)
def layer_weights(e, h, i, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5


@functools.lru_cache(maxsize=32)
def packed(method, group, sym, e, h, i, act="silu"):
    gu, dn = layer_weights(e, h, i)
    p = pack_layer(gu, dn, method, group_size=group, symmetric=sym, activation=act)
    return p, p.dequantized()


def routing(t, e, k, seed=1, dup=False):
    g = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        if t
        else torch.zeros(0, k, dtype=torch.long)
    )
    if dup and t:
        ids[:, -1] = ids[:, 0]  # the same expert twice for every token
    w = torch.rand(t, k, generator=g)
    return ids, w / w.sum(-1, keepdim=True).clamp_min(1e-6)


def oracle_quant(method, isa, x_dtype=torch.float32):
    if method == "FP8":  # bf16 activations on every ISA (x and the intermediate)
        return "bf16"
    if method == "BF16":  # activations keep x's precision (bf16 x: the activation is rounded to bf16)
        return "bf16" if x_dtype == torch.bfloat16 else None
    return "int8"


def check(
    method,
    group,
    sym,
    isa,
    pool,
    t,
    e,
    k,
    h,
    i,
    *,
    dup=False,
    skip=None,
    accumulate=False,
    dtype=torch.float32,
    ids_dtype=torch.int64,
    act="silu",
    seed=1,
    fp_check=True,
):
    p, (g2, d2) = packed(method, group, sym, e, h, i, act)
    layer = CPUMoELayer(p, isa=isa, pool=pool)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 7)).to(dtype)
    ids, w = routing(t, e, k, seed, dup)
    ids = ids.to(ids_dtype)
    base = torch.randn(t, h).to(dtype) if accumulate else None
    out = base.clone() if accumulate else torch.full((t, h), float("nan")).to(dtype)
    layer.forward(x, ids, w, out=out, accumulate=accumulate, skip_mask=skip)
    ref = moe_reference(x, ids, w, g2, d2, act, skip, oracle_quant(method, isa, dtype))
    if accumulate:
        ref = ref + base.float()
    if t == 0:
        assert out.shape == (0, h)
        return
    tol = 1.0 if dtype == torch.float32 else 4.0  # bf16 output adds its own rounding
    assert rel_error(out, ref) <= ORACLE_REL * tol, (rel_error(out, ref), max_error(out, ref))
    assert max_error(out, ref) <= ORACLE_MAX * tol, (rel_error(out, ref), max_error(out, ref))
    if fp_check and not accumulate:
        gu, dn = layer_weights(e, h, i)
        fp = moe_reference(x, ids, w, gu, dn, act, skip)
        assert rel_error(out, fp) <= FP_REL[method], rel_error(out, fp)


@pytest.mark.parametrize("method,group,sym", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize(
    "t,e,k,h,i", [(1, 8, 2, 128, 64), (3, 16, 4, 200, 72), (7, 8, 8, 136, 40)], ids=["t1", "t3_odd", "t7_odd"]
)
def test_small(method, group, sym, isa, pool, t, e, k, h, i):
    check(method, group, sym, isa, pool, t, e, k, h, i)


@pytest.mark.parametrize("method,group,sym", METHODS, ids=METHOD_IDS)
def test_many_rows_per_expert(method, group, sym, isa, pool):
    # ~75 rows per expert: the AMX tile path (>= 16 rows), row counts not a multiple of 16 or 32;
    # bf16 x as well: BF16's AVX-512/AMX kernels only run for bf16 activations
    check(method, group, sym, isa, pool, 150, 4, 2, 200, 96)
    check(method, group, sym, isa, pool, 150, 4, 2, 200, 96, dtype=torch.bfloat16, seed=3)


@pytest.mark.parametrize("method,group,sym", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("t", [1, 6, 63])
def test_decode_items_of_many_blocks(method, group, sym, isa, pool, t):
    # every token on all 8 experts, 64 w13 / 16 w2 N-blocks each: decode-sized items of up to 32 N-blocks
    # (moe.cpp few_row_cw), 63 rows the most a few-row item holds
    check(method, group, sym, isa, pool, t, 8, 8, 256, 512, fp_check=False)


@pytest.mark.parametrize("method,group,sym", METHODS, ids=METHOD_IDS)
def test_wide_routing(method, group, sym, isa, pool):
    # E=256, k=16, odd H and I
    check(method, group, sym, isa, pool, 40, 256, 16, 72, 40, fp_check=False)


@pytest.mark.parametrize("method,group,sym", METHODS[:2] + METHODS[3:5], ids=["int8", "int4g32", "bf16", "fp8"])
def test_long_prompt(method, group, sym, isa, pool):
    # T=5000: several 256-row chunks per expert
    check(method, group, sym, isa, pool, 5000, 4, 2, 64, 64, fp_check=False)
    if method in ("BF16", "FP8"):
        check(method, group, sym, isa, pool, 700, 4, 2, 64, 64, fp_check=False, dtype=torch.bfloat16)


@pytest.mark.parametrize("method,group,sym", METHODS, ids=METHOD_IDS)
def test_skip_duplicates_accumulate_bf16(method, group, sym, isa, pool):
    skip = torch.zeros(16, dtype=torch.bool)
    skip[[1, 5, 6, 11]] = True
    check(
        method,
        group,
        sym,
        isa,
        pool,
        9,
        16,
        4,
        136,
        72,
        dup=True,
        skip=skip,
        accumulate=True,
        dtype=torch.bfloat16,
        ids_dtype=torch.int32,
    )
    check(method, group, sym, isa, pool, 9, 16, 4, 136, 72, skip=skip, fp_check=False)


@pytest.mark.parametrize("t", [0, 2])
def test_t0_and_all_skipped(isa, pool, t):
    skip = torch.ones(8, dtype=torch.bool)
    check("AMXINT8", 128, True, isa, pool, t, 8, 2, 64, 64, skip=skip)
    check("AMXINT8", 128, True, isa, pool, t, 8, 2, 64, 64, skip=skip, accumulate=True)


@pytest.mark.parametrize("act", ["gelu", "swiglu_clamp"])
def test_other_activations(isa, pool, act):
    check("AMXINT8", 128, True, isa, pool, 5, 8, 2, 128, 64, act=act)
    check("BF16", 128, True, isa, pool, 40, 2, 2, 128, 64, act=act)
    check("FP8", 32, True, isa, pool, 40, 2, 2, 128, 64, act=act)


@pytest.mark.parametrize("group,sym", [(64, True), (128, True), (64, False), (128, False)],
                         ids=["g64", "g128", "g64a", "g128a"])
@pytest.mark.parametrize("t", [15, 16, 17, 33, 300])
def test_int4_row_counts(group, sym, isa, pool, t):
    # E = k = 2: every token on both experts, t rows each. On the AMX path, int4 with a group of 64 or 128
    # runs the tile kernel from 16 rows (one or two 16-row tile blocks, 32-row passes with a remainder,
    # 256-row chunks at 300); fewer rows and group 32 take the AVX-512 kernel
    check("AMXINT4", group, sym, isa, pool, t, 2, 2, 200, 96)
