"""Expert LoRA on CPU-resident experts (the native engine's LoRA kernels, cpu/lora_slots.py) served
end to end on the CPU device: a tiny random Qwen3-MoE stored in bf16 (so the BF16 CPU method holds
exactly the checkpoint's weights), run in float32 (fp32 LoRA slots: the adapter exactly), with a
hand-made adapter on attention, the dense MLP and every routed expert, with 0 (the all-CPU
backend), some (hybrid) and all experts on the GPU side: greedy tokens equal those of transformers
with the LoRA merged into its weights, and a mixed batch gives each request its own tokens. With
deferral (not exact by design: a token's deferred experts join the next layer) the deferred
tasks must carry the tokens' slots too."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import hand_adapter, merged_hf_model
from stream_emulation import emulate_stream

from hybridmoe import LLM
from hybridmoe.lora.cpu_bridge import CPUExpertLoRA

from tiny_models import hf_model

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _greedy(model, prompt: list[int], n: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    d = tmp_path_factory.mktemp("cpulora")
    hf_model(tiny_model_dir("qwen3_moe")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    base = d / "bf16"
    cfg = AutoConfig.from_pretrained(str(base))
    ad = hand_adapter(cfg, d / "ex", seed=3)
    prompt = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(7)).tolist()
    want = _greedy(merged_hf_model(base, ad), prompt)
    base_ids = _greedy(hf_model(base), prompt)
    assert want != base_ids, "the adapter must change the output for the test to mean anything"
    return base, ad, prompt, want, base_ids


@pytest.mark.parametrize("gpu_experts", [0, 4, 10], ids=["all_cpu", "hybrid", "all_gpu_side"])
def test_expert_lora_on_cpu_experts(setup, gpu_experts):
    base, ad, prompt, want, base_ids = setup
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, chunked_prefill_size=16, lora_paths=[str(ad)],
              kt_method="BF16", kt_num_gpu_experts=gpu_experts)
    names = {b.experts.name for b in llm.engine.runner.model.moe_blocks()}
    assert names == {"cpu" if gpu_experts == 0 else "hybrid"}
    mgr = llm.engine.runner.lora
    cpu_parts = [p for parts in mgr.expert_slots.values() for p in parts if isinstance(p, CPUExpertLoRA)]
    assert len(cpu_parts) == (2 if gpu_experts < 10 else 0)  # both MoE layers have a CPU share
    # the CPU share's slots are host memory (the startup memory plan's host line)
    assert mgr.nbytes()[1] >= sum(p.nbytes() for p in cpu_parts) > (0 if cpu_parts else -1)
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="ex")["output_ids"] == want
    outs = llm.generate(input_ids=[prompt, prompt, prompt[:-3]], sampling_params=GREEDY, lora_path=["ex", None, "ex"])
    assert outs[0]["output_ids"] == want and outs[1]["output_ids"] == base_ids
    assert outs[2]["output_ids"] == llm.generate(input_ids=prompt[:-3], sampling_params=GREEDY,
                                                 lora_path="ex")["output_ids"]
    llm.shutdown()


@pytest.mark.parametrize("gpu_experts", [0, 4])
def test_layerwise_prefill_keeps_the_split_for_expert_adapters(setup, gpu_experts):
    """--kt-gpu-prefill-token-threshold with expert LoRA: the streamed (CPU-resident) experts have no
    adapter rows on the GPU side, so a forward with expert-adapter tokens runs the CPU/GPU split (the
    CPU engine applies the CPU share) and gives the merged model's tokens; base-only forwards still
    stream."""
    base, ad, prompt, want, base_ids = setup
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[str(ad)], kt_method="BF16",
              kt_num_gpu_experts=gpu_experts, kt_gpu_prefill_token_threshold=8, disable_radix_cache=True)
    rt = next(iter(llm.engine.runner.model.moe_blocks())).experts.runtime
    assert rt.layerwise is not None and rt.layerwise_veto is not None
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="ex")["output_ids"] == want
    assert rt.num_layerwise_prefills == 0
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == base_ids
    assert rt.num_layerwise_prefills == 1
    outs = llm.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, lora_path=["ex", None])
    assert [o["output_ids"] for o in outs] == [want, base_ids] and rt.num_layerwise_prefills == 1
    llm.shutdown()


@pytest.mark.parametrize("gpu_experts", [4, 10])
def test_startup_plan_counts_the_expert_slots(setup, gpu_experts):
    """lora/plan.py's estimate from the adapter's header (in the plan before loading, so the fit check
    sees it) equals the slot buffers built after loading, but for their [S] scale/rank vectors."""
    from types import SimpleNamespace

    from hybridmoe.lora.plan import HOST_LINE, expert_slot_bytes

    base, ad, _, _, _ = setup
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[str(ad)], kt_method="BF16",
              kt_num_gpu_experts=gpu_experts, max_loras_per_batch=3)
    runner = llm.engine.runner
    blocks = list(runner.model.moe_blocks())
    masks = {b.layer_idx: b.experts.mask for b in blocks}
    args = SimpleNamespace(lora_paths=[str(ad)], kt_expert_lora_path=None, enable_lora=False, max_lora_rank=None,
                           max_loras_per_batch=3)
    cfg = runner.model.config
    gpu, host = expert_slot_bytes(args, cfg.hidden_size, blocks[0].intermediate, masks, "BF16", 128, 4)
    parts = [p for ps in runner.lora.expert_slots.values() for p in ps]
    cpu_parts = [p for p in parts if isinstance(p, CPUExpertLoRA)]
    real_host = sum(p.nbytes() for p in cpu_parts)
    real_gpu = sum(p.nbytes() for p in parts if not isinstance(p, CPUExpertLoRA))
    assert 0 <= real_host - host <= 8 * 3 * len(cpu_parts) and (host > 0) == (gpu_experts < 10)
    assert 0 <= real_gpu - gpu <= 4 * 3 * len(blocks) and gpu > 0
    if gpu_experts < 10:  # (on the CPU device the GPU-side share is host memory too: note_memory counts it there)
        assert runner.moe.memory_plan.host[HOST_LINE] >= real_host
    args.lora_paths = []  # no expert adapter: nothing
    assert expert_slot_bytes(args, cfg.hidden_size, blocks[0].intermediate, masks, "BF16", 128, 4) == (0, 0)
    llm.shutdown()


def test_dynamic_expert_update_is_refused(setup):
    from hybridmoe.lora.adapter import LoRAAdapterError

    base, ad, _, _, _ = setup
    with pytest.raises(LoRAAdapterError, match="kt-enable-dynamic-expert-update is not supported"):
        LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[str(ad)], kt_method="BF16",
            kt_num_gpu_experts=4, kt_gpu_prefill_token_threshold=8, kt_enable_dynamic_expert_update=True)


def test_deferred_tasks_carry_the_slots(setup, monkeypatch):
    from hybridmoe.moe.cpu_experts import CPUExperts

    base, ad, prompt, _, _ = setup
    seen: list = []
    real = CPUExperts.submit

    def spy(self, *args, lora_idx=None, **kw):
        seen.append(None if lora_idx is None else lora_idx.tolist())
        return real(self, *args, lora_idx=lora_idx, **kw)

    monkeypatch.setattr(CPUExperts, "submit", spy)
    opts = dict(device="cpu", dtype="float32", progress=False, lora_paths=[str(ad)], kt_method="BF16",
                kt_num_gpu_experts=4, kt_max_deferred_experts_per_token=1)
    llm = LLM(str(base), **opts)
    alone = llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="ex")["output_ids"]
    plain = llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    assert alone != plain
    seen.clear()
    outs = llm.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, lora_path=[None, "ex"])
    assert [o["output_ids"] for o in outs] == [plain, alone]
    # per forward: the immediate and the deferred task of each layer, both with both requests' slots
    assert seen and all(s is not None and -1 in s and 0 in s for s in seen), seen[:4]
    llm.shutdown()


@pytest.mark.parametrize("defer", [0, 1])
def test_stream_path_on_cpu(setup, monkeypatch, defer):
    """The CUDA stream path's data flow (pinned index buffer shared like x, the deferred task reading
    the immediate one's) emulated on the CPU (host functions and memory operations inline): the Python
    path's tokens."""
    from hybridmoe.moe import cuda_bridge, hybrid

    base, ad, prompt, want, base_ids = setup
    opts = dict(device="cpu", dtype="float32", progress=False, lora_paths=[str(ad)], kt_method="BF16",
                kt_num_gpu_experts=4, kt_max_deferred_experts_per_token=defer)
    ref = LLM(str(base), **opts)
    ref_tokens = [o["output_ids"] for o in ref.generate(input_ids=[prompt, prompt[:9], prompt], sampling_params=GREEDY,
                                                         lora_path=["ex", None, "ex"])]
    ref.shutdown()
    emulate_stream(monkeypatch)
    # per forward (marked "F" at its first MoE layer), whether each submit copies the slots: only the first
    events: list = []
    fwd = hybrid.HybridExperts._forward_stream

    def forward_stream(self, *a, **k):
        if self.is_first:
            events.append("F")
        return fwd(self, *a, **k)

    monkeypatch.setattr(hybrid.HybridExperts, "_forward_stream", forward_stream)
    for name in ("enqueue_submit", "enqueue_submit_with"):
        orig = getattr(cuda_bridge.StreamCPUTask, name)
        monkeypatch.setattr(cuda_bridge.StreamCPUTask, name,
                            lambda self, *a, _o=orig, **k: (events.append(a[-1] is not None), _o(self, *a, **k))[1])
    llm = LLM(str(base), **opts)
    got = [o["output_ids"] for o in llm.generate(input_ids=[prompt, prompt[:9], prompt], sampling_params=GREEDY,
                                                 lora_path=["ex", None, "ex"])]
    assert got == ref_tokens
    forwards = "".join("F" if e == "F" else "1" if e else "0" for e in events).split("F")[1:]
    assert forwards and all(f.startswith("1") and f.count("1") == 1 and len(f) >= 2 for f in forwards), forwards[:4]
    if not defer:
        assert got[0] == want
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_experts,defer", [(0, 0), (4, 0), (4, 1)], ids=["no_gpu_experts", "hybrid", "deferred"])
def test_cuda_graphs_cpu_expert_lora(setup, gpu_experts, defer):
    """On CUDA (the lead's H200): CPU-resident experts with LoRA driven from the stream, graphs on and
    off, a mixed batch of the adapter and the base against the CPU device's Python-driven path; the
    slot index is a graph input copied to the pinned buffer like x."""
    base, ad, prompt, want, base_ids = setup
    prompts = [prompt, prompt[:9], prompt[:15], prompt[2:]]
    loras = ["ex", None, "ex", None]
    opts = dict(dtype="float32", progress=False, lora_paths=[str(ad)], kt_method="BF16",
                kt_num_gpu_experts=gpu_experts, kt_max_deferred_experts_per_token=defer)
    cpu = LLM(str(base), device="cpu", **opts)
    ref = [o["output_ids"] for o in cpu.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)]
    cpu.shutdown()
    if not defer:
        assert ref[0] == want
    for graphs in (True, False):
        llm = LLM(str(base), device="cuda", disable_cuda_graph=not graphs, cuda_graph_max_bs=8, max_total_tokens=4096,
                  **opts)
        got = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)]
        assert got == ref, (graphs, gpu_experts, defer)
        if gpu_experts:  # (every expert on the CPU without a split: the runner turns graphs off itself)
            assert (llm.engine.runner.graphs is not None) == graphs
        llm.shutdown()
