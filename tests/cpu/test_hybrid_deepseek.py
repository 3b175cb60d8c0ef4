"""Hybrid DeepSeek (V2 and V3: shared experts, grouped routing): 0, some and all routed experts on
the GPU side give the all-GPU tokens, on the CPU device and on CUDA; the shared experts run inside
the CPU task's window."""

from __future__ import annotations

import pytest
import torch
from stream_emulation import emulate_stream

from hybridmoe import LLM

from test_hybrid import GREEDY, _rel
from tiny_models import assert_greedy_agrees, greedy_margins, hf_model, make_tiny_model

DS_EXPERTS = {"deepseek_v3": 8, "deepseek_v2": 9}


@pytest.fixture(scope="module")
def ds_model(tmp_path_factory):
    """kind -> a tiny DeepSeek checkpoint stored in bf16 (the BF16 CPU method holds exactly its weights)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            d = tmp_path_factory.mktemp(kind)
            hf_model(make_tiny_model(kind, d / "f32")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
            cache[kind] = d / "bf16"
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def ds_reference(ds_model):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            llm = LLM(str(ds_model(kind)), device="cpu", progress=False)  # every expert on the "GPU" side
            prompt = torch.randint(0, 150, (41,), generator=torch.Generator().manual_seed(5)).tolist()
            cache[kind] = (prompt, llm.prompt_logits(prompt),
                           llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"])
            llm.shutdown()
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", sorted(DS_EXPERTS))
@pytest.mark.parametrize("part", ["none", "some", "all"])
def test_deepseek_split_matches_all_on_gpu(ds_model, ds_reference, kind, part):
    """DeepSeek (shared experts computed in the CPU task's window, grouped routing) with 0, some
    and all routed experts on the "GPU" side: the all-torch tokens. Tolerance as
    test_split_matches_all_on_gpu (same bf16 weights, fp32 sums in another order: < 1e-5)."""
    n_gpu = {"none": 0, "some": 3, "all": DS_EXPERTS[kind]}[part]
    prompt, ref_logits, ref_tokens = ds_reference(kind)
    llm = LLM(str(ds_model(kind)), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=n_gpu)
    assert {b.experts.name for b in llm.engine.runner.model.moe_blocks()} == {"cpu" if n_gpu == 0 else "hybrid"}
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 1e-5
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    llm.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_shared_experts_run_while_the_cpu_works(ds_model, ds_reference, monkeypatch, stream):
    """In a hybrid layer the shared experts are issued after the CPU task's submit and before its
    wait (Python-driven path, and the CUDA stream path emulated on the CPU), and the result is the
    all-torch one."""
    from hybridmoe.moe import cpu_experts, cuda_bridge
    from hybridmoe.moe.layer import SparseMoEBlock

    events: list[str] = []
    if stream:
        emulate_stream(monkeypatch)
        for name, tag in (("enqueue_submit", "submit"), ("enqueue_result", "wait")):
            orig = getattr(cuda_bridge.StreamCPUTask, name)
            monkeypatch.setattr(cuda_bridge.StreamCPUTask, name,
                                lambda self, *a, _o=orig, _t=tag, **kw: (events.append(_t), _o(self, *a, **kw))[1])
    else:
        for name, tag in (("submit", "submit"), ("sync", "wait")):
            orig = getattr(cpu_experts.CPUExperts, name)
            monkeypatch.setattr(cpu_experts.CPUExperts, name,
                                lambda self, *a, _o=orig, _t=tag, **kw: (events.append(_t), _o(self, *a, **kw))[1])
    orig_shared = SparseMoEBlock.shared
    monkeypatch.setattr(SparseMoEBlock, "shared", lambda self, x: (events.append("shared"), orig_shared(self, x))[1])
    prompt, ref_logits, ref_tokens = ds_reference("deepseek_v3")
    llm = LLM(str(ds_model("deepseek_v3")), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3)
    events.clear()
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 1e-5
    n_moe = len(llm.engine.runner.model.moe_blocks())
    assert events == ["submit", "shared", "wait"] * n_moe, events
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(DS_EXPERTS))
@pytest.mark.parametrize("part", ["none", "some", "all"])
def test_deepseek_split_on_cuda_matches_all_on_gpu(ds_model, kind, part):
    """On the GPU (bf16, Triton experts, stream host functions, CUDA graphs): the greedy tokens of
    all experts on the GPU; logits < 3e-2 relative (bf16 sums on the GPU side, fp32 on the CPU
    side: as test_split_on_cuda_matches_all_on_gpu)."""
    n_gpu = {"none": 0, "some": 3, "all": DS_EXPERTS[kind]}[part]
    prompt = torch.randint(0, 150, (41,), generator=torch.Generator().manual_seed(5)).tolist()
    opts = dict(device="cuda", dtype="bfloat16", progress=False, max_total_tokens=4096, cuda_graph_max_bs=4)
    ref = LLM(str(ds_model(kind)), **opts)
    try:
        ref_logits = ref.prompt_logits(prompt)
        ref_tokens = ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        margins = greedy_margins(ref.prompt_logits, prompt, ref_tokens)
    finally:
        ref.shutdown()
    llm = LLM(str(ds_model(kind)), kt_method="BF16", kt_num_gpu_experts=n_gpu, **opts)
    try:
        logits = llm.prompt_logits(prompt)
        assert _rel(logits, ref_logits) < 3e-2
        # a flip is allowed only at a near tie: twice the largest logit difference seen on the prompt
        tie = 2 * float((logits.float() - ref_logits.float()).abs().max())
        got = llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        assert_greedy_agrees(got, ref_tokens, margins, tie)
    finally:
        llm.shutdown()
