"""The one-call attention half of a decoder layer (hybridmoe.cpu.layer_decode, csrc/layer_decode.cpp)
against the separate native forwards it sequences: the hidden states reaching the LM head at every
decode step are bit-identical (it calls the same kernels in the same order), the greedy tokens too,
on Qwen3-MoE (q/k norm) and Qwen2-MoE (qkv bias, shared experts with a gate, a dense router); it
steps aside for prefill, when switched off and when a projection was replaced (as LoRA does)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_fused_layers_equal_the_separate_calls(tmp_path, kind):
    from hybridmoe import LLM

    from tiny_models import lm_head_inputs, make_tiny_model

    path = make_tiny_model(kind, tmp_path / kind)
    llm = LLM(str(path), device="cpu", dtype="bfloat16", progress=False, kt_num_gpu_experts=0, kt_method="BF16")
    try:
        runner = llm.engine.runner
        ld = runner.layer_decode
        assert ld is not None and len(ld.layers) == len(runner.model.model.layers)
        prompt = torch.randint(0, 150, (19,), generator=torch.Generator().manual_seed(3)).tolist()
        ours, h_ours = lm_head_inputs(llm, prompt, GREEDY)
        calls = ld.native_calls
        assert calls >= (GREEDY["max_new_tokens"] - 1) * len(ld.layers)  # every decode step, every layer
        ld.enabled = False
        ref, h_ref = lm_head_inputs(llm, prompt, GREEDY)
        assert ld.native_calls == calls  # switched off: not called
        assert ours == ref
        assert len(h_ours) == len(h_ref) == GREEDY["max_new_tokens"]
        for a, b in zip(h_ours, h_ref):
            assert torch.equal(a, b)
        ld.enabled = True
        # a replaced projection (LoRA wraps it): that layer runs its own forward, same tokens
        attn = runner.model.model.layers[0].self_attn
        orig = attn.qkv_proj
        attn.qkv_proj = nn.Linear(orig.in_features, orig.out_features, bias=orig.bias is not None).bfloat16()
        attn.qkv_proj.load_state_dict(orig.state_dict())
        before = ld.native_calls
        again, _ = lm_head_inputs(llm, prompt, GREEDY)
        per_step = (ld.native_calls - before) / (GREEDY["max_new_tokens"] - 1)
        assert per_step == len(ld.layers) - 1
        attn.qkv_proj = orig
        # torch's own qkv GEMV on layer 0 rounds differently from the native one: tokens may differ, not the length
        assert len(again) == len(ours)
        ld.remove()
        assert all("forward" not in vars(layer) for layer in runner.model.model.layers)
    finally:
        llm.shutdown()


def test_layer_profile_counts_the_calls_and_parts(tmp_path):
    """native.layer_profile: one count per layer call, time in every part a call runs, zeroed by reset."""
    from hybridmoe import LLM
    from hybridmoe.cpu import native

    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "m")  # layer 1 dense: its MoE parts stay out
    llm = LLM(str(path), device="cpu", dtype="bfloat16", progress=False, kt_num_gpu_experts=0, kt_method="BF16")
    try:
        ld = llm.engine.runner.layer_decode
        native.layer_profile(reset=True)
        calls, moe = ld.native_calls, ld.moe_calls
        llm.generate(input_ids=list(range(5, 20)), sampling_params=GREEDY)
        prof = native.layer_profile(reset=True)
        assert prof["calls"] == ld.native_calls - calls > 0
        assert set(prof) == set(native.LAYER_PARTS) | {"calls"}
        assert all(prof[k] > 0 for k in ("qkv", "attention", "o_proj", "router", "routing", "moe_task"))
        assert moe < ld.moe_calls < ld.native_calls
        again = native.layer_profile(reset=False)
        assert again["calls"] == 0 and all(v == 0 for v in again.values())
    finally:
        llm.shutdown()
