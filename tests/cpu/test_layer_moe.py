"""The MoE block inside the one-call decoder layer (hybridmoe.cpu.layer_decode with moe_enabled,
csrc/layer_decode.cpp: native routing + the layer's expert task) against the same layer call with the
MoE block in Python (forward_logits -> route -> CPUExperts.forward -> CPUMoELayer.run), on tiny
random CPU-only models, on every ISA path this machine has:

- bit-identical: both route with the same native function (fused_ops.topk_softmax on CPU is
  hm_topk_softmax) and run the same expert task, so the LM head's inputs and logits at every decode
  step are equal, the greedy tokens too; also for a batch of 3 sequences, with the pool's inline runs
  off (the task queued to the pool's threads), renormalized routing or not, BF16, AMXINT8 and GGUF
  experts; the expert-distribution recorder counts the same selections;
- the old path where the block does not qualify: LoRA attached to the experts, experts replaced,
  routing that is not plain softmax, a score bias, shared experts, more rows than the call takes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridmoe.cpu import native

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def _llm(path, method: str = "BF16", **kw):
    from hybridmoe import LLM

    return LLM(str(path), device="cpu", dtype="bfloat16", progress=False, kt_num_gpu_experts=0, kt_method=method, **kw)


def _decode(llm, prompts: list[list[int]]) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """Greedy tokens of each prompt, and the LM head's inputs and logits at each decode step."""
    lm = llm.engine.runner.dense_linears.modules["lm_head"]
    native_fwd = lm.forward
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def spy(x):
        y = native_fwd(x)
        if x.shape[0] == len(prompts):  # decode steps (and the prompts' last rows)
            ins.append(x.clone())
            outs.append(y.clone())
        return y

    lm.forward = spy
    try:
        res = llm.generate(input_ids=prompts if len(prompts) > 1 else prompts[0], sampling_params=GREEDY)
    finally:
        lm.forward = native_fwd
    toks = [r["output_ids"] for r in res] if len(prompts) > 1 else [res["output_ids"]]
    return toks, ins, outs


def _prompts(n: int, vocab: int = 150, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (11 + 4 * i,), generator=g).tolist() for i in range(n)]


def _same(a, b) -> None:
    ta, ia, oa = a
    tb, ib, ob = b
    assert ta == tb
    assert len(ia) == len(ib) == GREEDY["max_new_tokens"]
    for x, y in zip(ia, ib):
        assert torch.equal(x, y)
    for x, y in zip(oa, ob):
        assert torch.equal(x, y)


def _fused_vs_python(llm, prompts, moe_layers: int) -> None:
    ld = llm.engine.runner.layer_decode
    ld.moe_enabled = True
    before = ld.moe_calls
    fused = _decode(llm, prompts)
    assert ld.moe_calls - before == (GREEDY["max_new_tokens"] - 1) * moe_layers  # every decode step, MoE layer
    ld.moe_enabled = False
    calls = ld.native_calls
    ref = _decode(llm, prompts)
    assert ld.moe_calls - before == (GREEDY["max_new_tokens"] - 1) * moe_layers  # not again
    assert ld.native_calls > calls  # the layer call still ran, its MoE block in Python
    ld.moe_enabled = True
    _same(fused, ref)


@pytest.mark.parametrize("method,renorm", [("BF16", True), ("AMXINT8", False)])
def test_fused_moe_equals_python_moe(tmp_path, monkeypatch, isa, method, renorm):
    from tiny_models import make_tiny_model

    monkeypatch.setenv("HYBRIDMOE_CPU_ISA", isa)
    path = make_tiny_model("qwen3_moe", tmp_path / "m", norm_topk_prob=renorm)
    llm = _llm(path, method)
    try:
        runner = llm.engine.runner
        ld = runner.layer_decode
        assert ld.moe_layers == {0, 2}  # layer 1 is a dense MLP (mlp_only_layers)
        block = runner.model.model.layers[0].mlp
        assert block.routing.renormalize == renorm
        emulated = isa == "amx" and native.amx_emulated()  # the tiles' software model (csrc/amx_tiles.h)
        assert block.experts.layer.kernel_name == isa + ("-emulated" if emulated else "")
        assert runner.dense_linears.isa_code == {"avx2": 0, "avx512": 1, "amx": 1}[isa]  # amx: AVX-512 dense
        recorder = block.experts.recorder
        c0 = {k: v.clone() for k, v in recorder.counts.items()}
        fused = _decode(llm, _prompts(1))
        c1 = {k: v.clone() for k, v in recorder.counts.items()}
        ld.moe_enabled = False
        ref = _decode(llm, _prompts(1))
        c2 = {k: v.clone() for k, v in recorder.counts.items()}
        ld.moe_enabled = True
        _same(fused, ref)
        for layer in (0, 2):  # the call counts its selections as the Python block's recorder does
            assert int((c1[layer] - c0[layer]).sum()) > 0
            assert torch.equal(c1[layer] - c0[layer], c2[layer] - c1[layer])
        _fused_vs_python(llm, _prompts(3), 2)  # T = 3 rows a call
        runner.dense_linears.pool.run_inline = False  # every pool call queued to the pool's threads
        try:
            _fused_vs_python(llm, _prompts(2, seed=4), 2)
        finally:
            runner.dense_linears.pool.run_inline = True
    finally:
        llm.shutdown()


class _NoLoRA:
    """A stand-in for an attached CPUExpertLoRA whose tokens all use the base model."""

    def index(self, t: int):
        return None


def test_fallbacks_take_the_python_block(tmp_path):
    from hybridmoe.cpu.layer_decode import _moe_part, install_layer_decode
    from hybridmoe.moe.layer import FP32Router

    from tiny_models import make_tiny_model

    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    llm = _llm(path)
    try:
        runner = llm.engine.runner
        ld = runner.layer_decode
        layer0 = runner.model.model.layers[0].mlp
        prompts = _prompts(1)
        want = _decode(llm, prompts)
        calls = ld.moe_calls
        # LoRA attached to layer 0's experts: that layer's block in Python, the same results
        layer0.experts.inner.lora = _NoLoRA()
        got = _decode(llm, prompts)
        layer0.experts.inner.lora = None
        assert ld.moe_calls - calls == GREEDY["max_new_tokens"] - 1  # layer 2 only
        _same(got, want)
        # experts replaced (here: the recorder's wrapper taken off): not the backend it was installed on
        wrapped = layer0.experts
        layer0.experts = wrapped.inner
        calls = ld.moe_calls
        got = _decode(llm, prompts)
        layer0.experts = wrapped
        assert ld.moe_calls - calls == GREEDY["max_new_tokens"] - 1
        _same(got, want)
        # more rows than one call takes: no layer call at all
        calls, native = ld.moe_calls, ld.native_calls
        _decode(llm, _prompts(5))
        assert ld.moe_calls == calls and ld.native_calls == native
        # routing other than plain softmax, a score bias, no bf16 router GEMV: not fused at install
        router = layer0.gate
        pool = runner.dense_linears.pool
        assert _moe_part(layer0, router, 72, pool) is not None
        plain = layer0.routing
        for routing in (dataclasses.replace(plain, scaling=2.0), dataclasses.replace(plain, scoring="sigmoid")):
            layer0.routing = routing
            assert _moe_part(layer0, router, 72, pool) is None
        layer0.routing = plain
        layer0.score_bias = True
        assert _moe_part(layer0, router, 72, pool) is None
        layer0.score_bias = False
        assert _moe_part(layer0, FP32Router(72, 10), 72, pool) is None
        assert _moe_part(layer0, None, 72, pool) is None
        layer0.routing = dataclasses.replace(plain, scaling=2.0)
        ld.remove()
        ld2 = install_layer_decode(runner.model, runner.dense_linears, runner.attn_decode)
        layer0.routing = plain
        assert ld2.moe_layers == {2}
        runner.layer_decode = ld2
        ld2.remove()
    finally:
        llm.shutdown()


def test_shared_experts_stay_in_python(tmp_path):
    from tiny_models import make_tiny_model

    llm = _llm(make_tiny_model("qwen2_moe", tmp_path / "m"))
    try:
        ld = llm.engine.runner.layer_decode
        assert ld.layers and ld.moe_layers == set()
        _decode(llm, _prompts(1))
        assert ld.moe_calls == 0 and ld.native_calls > 0
    finally:
        llm.shutdown()


def test_gguf_experts_fused(tmp_path):
    """--kt-method LLAMAFILE: the GGUF layer runs through the same task runner, so it fuses too."""
    from test_gguf_e2e import INTER, E, H, write_gguf

    from tiny_models import make_tiny_model

    ckpt = make_tiny_model("qwen3_moe", tmp_path / "hf", hidden_size=H, moe_intermediate_size=INTER,
                           mlp_only_layers=[], std=0.1)
    write_gguf(ckpt, tmp_path / "experts.gguf")
    llm = _llm(ckpt, "LLAMAFILE", kt_weight_path=str(tmp_path / "experts.gguf"))
    try:
        runner = llm.engine.runner
        assert type(runner.model.model.layers[0].mlp.experts.layer).__name__ == "GGUFMoELayer"
        assert runner.layer_decode.moe_layers == {0, 1, 2} and E == 10
        _fused_vs_python(llm, _prompts(1), 3)
    finally:
        llm.shutdown()
