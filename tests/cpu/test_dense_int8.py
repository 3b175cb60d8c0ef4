"""--cpu-dense-weights int8: the dense linears' int8 path (dense.pack_int8 / dense_linear_int8 on
csrc/dense_api.cpp's q8 path, the int8 experts' kernels on one "expert") against its definition
(dense_linear_int8_reference: per-row int8 weights, per-token int8 activations, exact integer dots,
both scales in fp32), on every ISA path this machine has; and CPU-only decode with it: the one-call
layers read the same copies as the separate calls (bit-identical), routers stay bf16, and the decode
hidden states stay within a stated tolerance of the bf16 path.

Tolerances: the kernels against the reference: 1e-6 relative to the largest output (the integer dots
are exact; only the order of the two scale products may differ). Decode against bf16 (tiny random
models, H = 64): the LM head's input after one int8 decode step within 0.1 relative (measured 0.028);
that is the per-token activation quantization of every linear, as the INT8 experts have it."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.cpu import dense, native

ISAS = [i for i in ("avx2", "avx512") if not native.isa_missing(i)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def pool():
    from hybridmoe.cpu.engine import CPUThreadPool

    p = CPUThreadPool(threads=2)
    yield p
    p.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t,n,k", [(1, 5000, 2048), (3, 130, 200), (4, 64, 64), (16, 1000, 520), (2, 17, 1),
                                   (5, 4096, 96)])
def test_int8_dense_equals_its_definition(pool, isa, t, n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(t, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    q = dense.pack_int8(w, pool=pool)
    assert (q.n, q.k, q.n_pad % 64, q.k_pad % 64) == (n, k, 0, 0) and q.n_pad >= n and q.k_pad >= k
    for bias in (None, b):
        got = dense.dense_linear_int8(x, q, bias, out_dtype=torch.float32, pool=pool, isa=isa)
        ref = dense.dense_linear_int8_reference(x, w, bias, out_dtype=torch.float32)
        assert got.shape == (t, n)
        assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    # bf16 out: the fp32 result rounded
    got16 = dense.dense_linear_int8(x, q, b, pool=pool, isa=isa)
    assert torch.equal(got16, dense.dense_linear_int8(x, q, b, out_dtype=torch.float32, pool=pool,
                                                      isa=isa).bfloat16())


def test_int8_dense_edges(pool):
    w = torch.randn(96, 128).bfloat16()
    q = dense.pack_int8(w, pool=pool)
    assert dense.dense_linear_int8(torch.empty(0, 128).bfloat16(), q, pool=pool).shape == (0, 96)  # T = 0
    # a zero row quantizes to scale 0: zeros out, no NaN
    z = dense.dense_linear_int8(torch.zeros(1, 128).bfloat16(), q, pool=pool)
    assert torch.equal(z, torch.zeros(1, 96).bfloat16())
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        dense.dense_linear_int8(torch.randn(17, 128).bfloat16(), q, pool=pool)
    bad = torch.randn(3, 128).bfloat16()
    bad[1, 5] = float("nan")
    with pytest.raises(RuntimeError, match="row 1 of the input holds NaN or Inf") as err:
        dense.dense_linear_int8(bad, q, pool=pool)
    assert err.value.token == 1  # a CPUMoEError: the engine fails that token's request alone
    with pytest.raises(ValueError, match="bf16 CPU x"):
        dense.dense_linear_int8(torch.randn(1, 64).bfloat16(), q, pool=pool)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_cpu_only_decode_with_int8_linears(tmp_path, kind):
    from hybridmoe import LLM

    from tiny_models import lm_head_inputs, make_tiny_model

    path = make_tiny_model(kind, tmp_path / kind)
    prompt = torch.randint(0, 150, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    # no prefix cache: a repeated prompt would otherwise run its last row through the one-row (native) path
    kw = dict(device="cpu", dtype="bfloat16", progress=False, kt_num_gpu_experts=0, kt_method="BF16",
              disable_radix_cache=True)
    base = LLM(str(path), **kw)
    try:
        ref_tokens, ref_h = lm_head_inputs(base, prompt, GREEDY)
    finally:
        base.shutdown()
    llm = LLM(str(path), **kw, cpu_dense_weights="int8")
    try:
        runner = llm.engine.runner
        dl, ld = runner.dense_linears, runner.layer_decode
        model = runner.model
        routers = {id(getattr(b, b.gate_name)) for b in model.moe_blocks()}
        assert routers and all(dl.int8_of(m) is None for m in dl.modules.values() if id(m) in routers)
        assert dl.int8_of(dl.modules["lm_head"]) is not None
        assert all(dl.int8_of(layer.self_attn.qkv_proj) is not None for layer in model.model.layers)
        tokens, h = lm_head_inputs(llm, prompt, GREEDY)
        assert ld is not None and ld.native_calls > 0
        # prefill is torch's bf16 GEMM in both: the first token and the prompt's last row are the same
        assert tokens[0] == ref_tokens[0] and torch.equal(h[0], ref_h[0])
        rel = (h[1].float() - ref_h[1].float()).norm() / ref_h[1].float().norm()
        assert 0 < rel < 0.1, rel  # int8 was read (not 0), within the stated tolerance
        # the one-call layers and the separate calls read the same int8 copies: bit-identical
        ld.enabled = False
        tokens2, h2 = lm_head_inputs(llm, prompt, GREEDY)
        assert tokens2 == tokens and all(torch.equal(a, b) for a, b in zip(h, h2))
        # int8 switched off (benchmarks' A/B): the bf16 path's values again
        ld.enabled, dl.int8_enabled = True, False
        tokens3, h3 = lm_head_inputs(llm, prompt, GREEDY)
        assert tokens3 == ref_tokens and all(torch.equal(a, b) for a, b in zip(h3, ref_h))
    finally:
        llm.shutdown()


def test_flag_is_checked():
    import argparse

    from hybridmoe.args import add_engine_args, engine_args_from
    from hybridmoe.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError, match="cpu-dense-weights"):
        EngineArgs(model_path="x", cpu_dense_weights="int4").validate()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--cpu-dense-weights", "int8"])).cpu_dense_weights == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-dense-weights", "fp4"])
