"""Expert LoRA on the CPU engine (csrc/lora.h, cpu/lora_slots.py) against the float64 reference
(lora_slots.moe_lora_reference), for every method and every ISA path this machine has.

The reference applies the method's own activation rounding to the base path (int8 per row, bf16,
the GGUF Q8_K-style rounding) on the dequantized weights and keeps the low-rank terms unrounded,
as the kernels do; adapters are drawn bf16-representable, so bf16 slots hold them exactly. The
difference is then summation order and an occasional 1-LSB flip of a quantized activation, as in
test_cpu_kernels.py: rel <= 2e-3, max <= 2e-2 (x4 with bf16 output). Tokens without an adapter
(-1, an empty slot, a cleared one) must give the base task's output bit for bit.
"""

import functools

import pytest
import torch

from hybridmoe.cpu import gguf_quant as gq
from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.gguf_engine import GGUFExperts, GGUFMoELayer
from hybridmoe.cpu.lora_slots import moe_lora_reference
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.cpu.reference import max_error, rel_error

ORACLE_REL, ORACLE_MAX = 2e-3, 2e-2
METHODS = [("AMXINT8", 128, True), ("AMXINT4", 32, True), ("AMXINT4", 128, False), ("BF16", 128, True),
           ("FP8", 32, True)]
METHOD_IDS = ["int8", "int4g32", "int4g128a", "bf16", "fp8b32"]


@functools.lru_cache(maxsize=16)
def packed(method, group, sym, e, h, i):
    g = torch.Generator().manual_seed(e * 1000 + h + i)
    gu, dn = torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5
    p = pack_layer(gu, dn, method, group_size=group, symmetric=sym)
    return p, p.dequantized()


def act_quant(method, x_dtype):
    if callable(method):  # a GGUF layer: its Q8_K-style rounding
        return method
    if method == "FP8":
        return "bf16"
    if method == "BF16":
        return "bf16" if x_dtype == torch.bfloat16 else None
    return "int8"


def adapter(e, h, i, r, seed, scaling=0.75):
    """(gate_A, gate_B, up_A, up_B, down_A, down_B, scaling): bf16-representable fp32 values."""
    g = torch.Generator().manual_seed(seed)

    def f(*shape):
        return (torch.randn(*shape, generator=g) * 0.4).bfloat16().float()

    return f(e, r, h), f(e, i, r), f(e, r, h), f(e, i, r), f(e, r, i), f(e, h, r), scaling


def routing(t, e, k, seed, dup=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    if dup and t:
        ids[:, -1] = ids[:, 0]  # the same expert twice for every token
    return ids, torch.rand(t, k, generator=g)


def run(layer, loras, t, e, k, h, *, idx, dq, method, slot_dtype=torch.bfloat16, dtype=torch.float32, dup=False,
        skip=None, seed=1, slots=3, max_rank=8, check_base=True):
    """Forward with LoRA slots `loras` and per-token slots `idx`; checks against the reference and,
    for the tokens without an adapter, against the base task bit for bit. Returns the output."""
    if layer.lora is None:
        layer.attach_lora(0, slots, max_rank, slot_dtype)
    for s in range(slots):
        if s in loras:
            layer.set_lora_slot(0, s, *loras[s])
        else:
            layer.clear_lora_slot(0, s)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 7)).to(dtype)
    ids, w = routing(t, e, k, seed, dup)
    li = torch.tensor(idx, dtype=torch.int32)
    out = layer.forward(x, ids, w, out=torch.full((t, h), float("nan")).to(dtype), skip_mask=skip, lora_idx=li)
    ref = moe_lora_reference(x, ids, w, *dq, loras, li, skip=skip, act_quant=act_quant(method, dtype))
    if t == 0:
        assert out.shape == (0, h)
        return out
    tol = 1.0 if dtype == torch.float32 else 4.0
    assert rel_error(out, ref) <= ORACLE_REL * tol, (rel_error(out, ref), max_error(out, ref))
    assert max_error(out, ref) <= ORACLE_MAX * tol, (rel_error(out, ref), max_error(out, ref))
    if check_base:
        base = layer.forward(x, ids, w, skip_mask=skip)
        plain = torch.tensor([s < 0 or s not in loras for s in idx])
        assert torch.equal(out[plain], base.to(dtype)[plain])
        if (~plain).any() and skip is None:  # the adapters matter where they apply
            assert rel_error(base[~plain], ref[~plain]) > 0.05
    return out


@pytest.mark.parametrize("method,group,sym", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("slot_dtype", [torch.bfloat16, torch.float32], ids=["bf16slots", "f32slots"])
def test_methods_mixed_slots(method, group, sym, slot_dtype, isa, pool):
    # odd sizes (H=136, I=72 padded to 192 / 128), rank 8 = max and rank 3 < max, an empty slot 1
    e, k, h, i = 8, 3, 136, 72
    p, dq = packed(method, group, sym, e, h, i)
    layer = CPUMoELayer(p, isa=isa, pool=pool)
    loras = {0: adapter(e, h, i, 8, 1), 2: adapter(e, h, i, 3, 2, scaling=2.0)}
    run(layer, loras, 9, e, k, h, idx=[0, -1, 2, 1, 0, 2, -1, 0, 2], dq=dq, method=method, slot_dtype=slot_dtype)


@pytest.mark.parametrize("method,group,sym", METHODS[::3], ids=METHOD_IDS[::3])
def test_t0_t1_bf16_duplicates_skip(method, group, sym, isa, pool):
    e, k, h, i = 6, 4, 200, 40
    p, dq = packed(method, group, sym, e, h, i)
    layer = CPUMoELayer(p, isa=isa, pool=pool)
    loras = {1: adapter(e, h, i, 5, 3)}
    run(layer, loras, 0, e, k, h, idx=[], dq=dq, method=method)
    run(layer, loras, 1, e, k, h, idx=[1], dq=dq, method=method)
    run(layer, loras, 1, e, k, h, idx=[-1], dq=dq, method=method)
    run(layer, loras, 5, e, k, h, idx=[1, 1, -1, 1, 0], dq=dq, method=method, dup=True, dtype=torch.bfloat16)
    skip = torch.zeros(e, dtype=torch.bool)
    skip[[0, 4]] = True
    run(layer, loras, 6, e, k, h, idx=[1, -1, 1, 1, -1, 1], dq=dq, method=method, skip=skip)


@pytest.mark.parametrize("method,group,sym", [METHODS[0], METHODS[3]], ids=["int8", "bf16"])
def test_many_rows_parallel_phases(method, group, sym, isa, pool):
    # 300 rows per expert (two 256-row items, the 8-block items of >= 64 rows), phases on all threads
    e, k, h, i = 2, 1, 72, 136
    p, dq = packed(method, group, sym, e, h, i)
    layer = CPUMoELayer(p, isa=isa, pool=pool)
    loras = {0: adapter(e, h, i, 8, 5), 1: adapter(e, h, i, 7, 6)}
    idx = [(j % 3) - 1 for j in range(600)]
    run(layer, loras, 600, e, k, h, idx=idx, dq=dq, method=method, slots=2)


@pytest.mark.parametrize("method,group,sym", [METHODS[0], METHODS[3]], ids=["int8", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.bfloat16, torch.float32], ids=["bf16slots", "f32slots"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32x", "bf16x"])  # bf16 x and slots: vdpbf16ps
def test_runs_of_one_slot(method, group, sym, slot_dtype, dtype, isa, pool):
    # prefill-like: each request's tokens in a run, so an expert's rows come in runs of one slot (the
    # kernels take up to 4 rows at once): runs of 1..9 rows broken by other slots and by -1; ranks
    # 5 and 7 (not multiples of the 4-rank tiles); H = 131, I = 37 (tails of 16 and of 8 lanes)
    e, k, h, i = 3, 2, 131, 37
    p, dq = packed(method, group, sym, e, h, i)
    layer = CPUMoELayer(p, isa=isa, pool=pool)
    loras = {0: adapter(e, h, i, 5, 11), 1: adapter(e, h, i, 7, 12, scaling=1.5), 2: adapter(e, h, i, 8, 13)}
    idx = [0] * 9 + [1] * 5 + [-1] * 2 + [0] * 3 + [2] * 7 + [1] * 2 + [0] + [2] * 4
    run(layer, loras, len(idx), e, k, h, idx=idx, dq=dq, method=method, slot_dtype=slot_dtype, dtype=dtype, slots=3)


def test_clear_and_reload(isa, pool):
    e, k, h, i = 4, 2, 64, 64
    p, dq = packed("AMXINT8", 128, True, e, h, i)
    layer = CPUMoELayer(p, isa=isa, pool=pool)
    a, b = adapter(e, h, i, 4, 7), adapter(e, h, i, 2, 8)
    run(layer, {0: a}, 4, e, k, h, idx=[0, 0, -1, 0], dq=dq, method="AMXINT8", slots=1, max_rank=4)
    run(layer, {}, 4, e, k, h, idx=[0, 0, -1, 0], dq=dq, method="AMXINT8", slots=1, max_rank=4)  # cleared: base
    run(layer, {0: b}, 4, e, k, h, idx=[0, 0, -1, 0], dq=dq, method="AMXINT8", slots=1, max_rank=4)  # lower rank
    w0 = layer.lora.w.data_ptr()
    layer.clear_lora_slot(0, 0)
    assert layer.lora.w.data_ptr() == w0 and not layer.lora.w.any() and int(layer.lora.rank[0]) == 0


@functools.lru_cache(maxsize=4)
def gguf_experts(types, e, h, i):
    g = torch.Generator().manual_seed(11)
    mats = [gq.quantize(torch.randn(e, n, kk, generator=g) / kk**0.5, t) for t, (n, kk) in
            zip(types, ((i, h), (i, h), (h, i)))]
    ex = GGUFExperts.of(*mats, types)
    return ex, ex.dequantized()


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "IQ4_XS", "Q5_K")], ids=["q4k", "mixed"])
def test_gguf_layers(types, isa, pool):
    e, k, h, i = 4, 2, 256, 512
    ex, dq = gguf_experts(types, e, h, i)
    layer = GGUFMoELayer(ex, isa=isa, pool=pool)
    loras = {0: adapter(e, h, i, 6, 9), 1: adapter(e, h, i, 8, 10)}
    run(layer, loras, 7, e, k, h, idx=[0, 1, -1, 1, 0, 0, -1], dq=dq, method=gq.act_round_q8k, slots=2)


def test_errors(pool):
    e, k, h, i = 4, 2, 64, 64
    p, _ = packed("AMXINT8", 128, True, e, h, i)
    layer = CPUMoELayer(p, pool=pool)
    x, ids, w = torch.randn(2, h), torch.zeros(2, k, dtype=torch.long), torch.ones(2, k)
    with pytest.raises(ValueError, match="no LoRA slots attached"):
        layer.set_lora_slot(0, 0, *adapter(e, h, i, 2, 1))
    layer.attach_lora(3, 2, 4)
    with pytest.raises(ValueError, match="already attached"):
        layer.attach_lora(3, 2, 4)
    with pytest.raises(ValueError, match="rank 5 not in"):
        layer.set_lora_slot(3, 0, *adapter(e, h, i, 5, 1))
    bad = list(adapter(e, h, i, 2, 1))
    bad[3] = bad[3][:, :-1]
    with pytest.raises(ValueError, match=r"up_B must be \[4, 64, 2\]"):
        layer.set_lora_slot(3, 0, *bad)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        layer.clear_lora_slot(3, 2)
    with pytest.raises(ValueError, match="lora_idx must be an int32 CPU tensor"):
        layer.submit(x, ids.int(), w, torch.empty(2, h), lora_idx=torch.zeros(3, dtype=torch.int32))
    layer.set_lora_slot(3, 1, *adapter(e, h, i, 2, 1))
    with pytest.raises(CPUMoEError, match="LoRA slot 2 of token 1 out of range"):
        layer.forward(x, ids, w, lora_idx=torch.tensor([1, 2], dtype=torch.int32))
    layer.forward(x, ids, w, lora_idx=torch.tensor([1, -1], dtype=torch.int32))  # later tasks run normally


@pytest.mark.parametrize("threads,subpools", [(1, 1), (3, 1), (4, 2)], ids=["1t", "3t", "4t2sub"])
def test_units_in_the_gemm_queues(threads, subpools, isa):
    # the rank products run as units at the head of the GEMM items' queues (round robin over the
    # sub-pools) and the items of an expert wait for its units: decode-sized tasks (T = 1, 4 with 4
    # slots) on 1 thread, 3 threads, and 2 sub-pools; rank 16 (4 units a part) and 6 (a partial unit)
    e, k, h, i = 12, 8, 256, 96
    p, dq = packed("AMXINT8", 128, True, e, h, i)
    pool = CPUThreadPool(threads=threads, threadpool_count=subpools)
    try:
        layer = CPUMoELayer(p, isa=isa, pool=pool)
        loras = {0: adapter(e, h, i, 16, 21), 1: adapter(e, h, i, 6, 22), 2: adapter(e, h, i, 16, 23),
                 3: adapter(e, h, i, 1, 24)}
        ids_skip = torch.zeros(e, dtype=torch.bool)
        ids_skip[:3] = True  # some pairs on "the GPU"
        run(layer, loras, 1, e, k, h, idx=[0], dq=dq, method="AMXINT8", slots=4, max_rank=16, dtype=torch.bfloat16)
        run(layer, loras, 4, e, k, h, idx=[0, 1, 2, 3], dq=dq, method="AMXINT8", slots=4, max_rank=16,
            dtype=torch.bfloat16, skip=ids_skip)
        run(layer, loras, 4, e, k, h, idx=[1, -1, 1, 3], dq=dq, method="AMXINT8", slots=4, max_rank=16, seed=5)
    finally:
        del layer
        pool.close()
