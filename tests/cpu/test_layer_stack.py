"""Every decoder layer of a decode step in one native call (hybridmoe.cpu.layer_decode's stacked call,
csrc/layer_decode.cpp hm_layers_decode) against the per-layer calls it chains: layer 0's input norm,
each layer's one-call forward with its MoE block inside, the final norm, in the same order with the same
kernels, so the LM head's inputs and logits at every decode step are bit-identical, the greedy tokens and
the expert-distribution counts too; for 1 and 3 rows, BF16 and AMXINT8 experts, int8 dense linears,
the pool's inline runs off, on every ISA path this machine has. It steps aside (the per-layer forwards
run that step) where a layer does not qualify, and is not installed on models with a dense-MLP layer or
shared experts. Its errors name the layer.
"""

from __future__ import annotations

import ctypes as C

import pytest
import torch
from test_layer_moe import GREEDY, _decode, _llm, _NoLoRA, _prompts, _same


def _stack_vs_layers(llm, prompts) -> None:
    """The stacked call on and off give the same everything; the stacked call ran every decode step."""
    ld = llm.engine.runner.layer_decode
    ld.stack_enabled = True
    before, moe = ld.stack_calls, ld.moe_calls
    stacked = _decode(llm, prompts)
    steps = GREEDY["max_new_tokens"] - 1
    assert ld.stack_calls - before == steps
    assert ld.moe_calls - moe == steps * len(ld.layers)
    ld.stack_enabled = False
    per_layer = _decode(llm, prompts)
    assert ld.stack_calls - before == steps  # not again
    assert ld.moe_calls - moe == 2 * steps * len(ld.layers)  # the per-layer calls ran instead
    ld.stack_enabled = True
    _same(stacked, per_layer)


@pytest.mark.parametrize("method", ["BF16", "AMXINT8"])
def test_stack_equals_the_per_layer_calls(tmp_path, monkeypatch, isa, method):
    from tiny_models import make_tiny_model

    monkeypatch.setenv("HYBRIDMOE_CPU_ISA", isa)
    path = make_tiny_model("qwen3_moe", tmp_path / "m", mlp_only_layers=[], num_hidden_layers=4)
    llm = _llm(path, method)
    try:
        runner = llm.engine.runner
        ld = runner.layer_decode
        assert ld.model is runner.model and ld.moe_layers == {0, 1, 2, 3}
        recorder = runner.model.model.layers[0].mlp.experts.recorder
        c0 = {k: v.clone() for k, v in recorder.counts.items()}
        _stack_vs_layers(llm, _prompts(1))
        c1 = {k: v.clone() for k, v in recorder.counts.items()}
        for layer in range(4):  # the stacked call counted what the per-layer calls counted
            assert int((c1[layer] - c0[layer]).sum()) > 0
        recorder.counts.clear()  # new counts tensors: the stacked call points at them from then on
        _decode(llm, _prompts(1))
        stacked = {k: v.clone() for k, v in recorder.counts.items()}
        recorder.counts.clear()
        ld.stack_enabled = False
        _decode(llm, _prompts(1))
        ld.stack_enabled = True
        assert stacked.keys() == recorder.counts.keys()
        for k in stacked:
            assert torch.equal(stacked[k], recorder.counts[k])
        _stack_vs_layers(llm, _prompts(3))  # T = 3 rows
        runner.dense_linears.pool.run_inline = False  # every pool call queued to the pool's threads
        try:
            _stack_vs_layers(llm, _prompts(2, seed=4))
        finally:
            runner.dense_linears.pool.run_inline = True
    finally:
        llm.shutdown()


def test_stack_with_int8_dense_and_mixtral(tmp_path):
    from hybridmoe import LLM

    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "q", mlp_only_layers=[])
    llm = LLM(str(path), device="cpu", dtype="bfloat16", progress=False, kt_num_gpu_experts=0, kt_method="BF16",
              cpu_dense_weights="int8")
    try:
        dl = llm.engine.runner.dense_linears
        assert dl.int8_enabled
        _stack_vs_layers(llm, _prompts(2))
        dl.int8_enabled = False  # another plan (the bf16 weights), then back
        _stack_vs_layers(llm, _prompts(1))
        dl.int8_enabled = True
        _stack_vs_layers(llm, _prompts(1, seed=5))
    finally:
        llm.shutdown()
    llm = _llm(make_tiny_model("mixtral", tmp_path / "x"))
    try:
        _stack_vs_layers(llm, _prompts(2, vocab=200))
    finally:
        llm.shutdown()


def test_stack_steps_aside(tmp_path):
    from torch import nn

    from tiny_models import make_tiny_model

    llm = _llm(make_tiny_model("qwen3_moe", tmp_path / "m", mlp_only_layers=[]))
    try:
        runner = llm.engine.runner
        ld = runner.layer_decode
        n = len(ld.layers)
        prompts = _prompts(1)
        want = _decode(llm, prompts)
        steps = GREEDY["max_new_tokens"] - 1
        # LoRA attached to layer 1's experts: the per-layer calls, that layer's block in Python
        layer1 = runner.model.model.layers[1].mlp
        layer1.experts.inner.lora = _NoLoRA()
        stack, moe = ld.stack_calls, ld.moe_calls
        got = _decode(llm, prompts)
        layer1.experts.inner.lora = None
        assert ld.stack_calls == stack and ld.moe_calls - moe == steps * (n - 1)
        _same(got, want)
        # a replaced projection (LoRA wraps it): that layer runs its own forward, the others their calls
        attn = runner.model.model.layers[2].self_attn
        orig = attn.o_proj
        attn.o_proj = nn.Linear(orig.in_features, orig.out_features, bias=False).bfloat16()
        attn.o_proj.load_state_dict(orig.state_dict())
        native = ld.native_calls
        _decode(llm, prompts)
        attn.o_proj = orig
        assert ld.stack_calls == stack and ld.native_calls - native == steps * (n - 1)
        # more rows than one call takes, or switched off: no stacked call
        _decode(llm, _prompts(5))
        ld.enabled = False
        _decode(llm, prompts)
        ld.enabled = True
        assert ld.stack_calls == stack
        assert _decode(llm, prompts)[0] == want[0] and ld.stack_calls == stack + steps
        model = runner.model
        ld.remove()
        assert "forward" not in vars(model) and ld.model is None
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind,over", [("qwen3_moe", {}), ("qwen2_moe", {})])
def test_not_installed_with_dense_or_shared_layers(tmp_path, kind, over):
    """Qwen3-MoE with mlp_only_layers (a dense MLP layer), Qwen2-MoE (shared experts): per-layer calls."""
    from tiny_models import make_tiny_model

    llm = _llm(make_tiny_model(kind, tmp_path / "m", **over))
    try:
        ld = llm.engine.runner.layer_decode
        assert ld.model is None and "forward" not in vars(llm.engine.runner.model)
        _decode(llm, _prompts(1))
        assert ld.stack_calls == 0 and ld.native_calls > 0
    finally:
        llm.shutdown()


def test_native_errors_name_the_layer(tmp_path):
    from hybridmoe.cpu.layer_decode import DecodeStack, _lib

    from tiny_models import make_tiny_model

    llm = _llm(make_tiny_model("qwen3_moe", tmp_path / "m", mlp_only_layers=[]))
    try:
        ld = llm.engine.runner.layer_decode
        _decode(llm, _prompts(1))
        (plan,) = ld._plans.values()  # one row, bf16 linears
        err = C.create_string_buffer(512)
        pool = ld.dl.pool.handle
        assert _lib().hm_layers_decode(pool, plan.ptrs, C.byref(DecodeStack()), err, len(err)) == 1
        assert b"no layers or rows" in err.value
        bad = DecodeStack.from_buffer_copy(plan.stack)
        bad.T = 2  # the layers were set up for one row
        assert _lib().hm_layers_decode(pool, plan.ptrs, C.byref(bad), err, len(err)) == 1
        assert err.value.startswith(b"hm_layers_decode: layer 0 was set up for other sizes")
        keep = plan.structs[1].qkv.K
        plan.structs[1].qkv.K = 0  # a broken layer struct: its own error, with its index
        x = torch.zeros(1, plan.stack.H, dtype=torch.bfloat16)
        bad = DecodeStack.from_buffer_copy(plan.stack)
        bad.x = bad.out = x.data_ptr()
        try:
            assert _lib().hm_layers_decode(pool, plan.ptrs, C.byref(bad), err, len(err)) == 1
        finally:
            plan.structs[1].qkv.K = keep
        assert err.value.startswith(b"layer 1: hm_dense: T and N must be >= 0 and K >= 1"), err.value
    finally:
        llm.shutdown()
