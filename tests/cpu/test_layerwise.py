"""Layerwise GPU prefill (--kt-gpu-prefill-token-threshold) and dynamic expert update
(--kt-enable-dynamic-expert-update) with `--device cpu`: both sides on the CPU (the "GPU" side is
the torch backend, the copies plain CPU copies), the same layer code as on a GPU machine.

Tolerances: with the BF16 method the streamed experts are the checkpoint's bf16 weights exactly,
so a layerwise forward differs from the all-on-"GPU" model only in the fp32 summation order
(two expert calls summed): logits < 1e-5 relative, same greedy tokens. With AMXINT8 the streamed
weights are the int8-dequantized ones (activations not quantized): logits within 5e-2 relative
of the bf16 model (measured ~1e-2)."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridmoe import LLM, cuda_driver
from hybridmoe.config import ConfigError, HybridConfig
from hybridmoe.cpu import dequant
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.moe import layerwise
from hybridmoe.moe.experts import ExpertWeights
from hybridmoe.moe.hybrid import HybridExperts
from hybridmoe.moe.options import ExpertsOptions
from hybridmoe.moe.placement import HybridPlacement
from hybridmoe.moe.runtime import HybridRuntime
from hybridmoe.moe.torch_experts import TorchExperts

from tiny_models import hf_model, make_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
BASE = dict(device="cpu", progress=False, kt_method="BF16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Tiny Qwen3-MoE (10 experts, top-3, MoE layers 0 and 2) stored in bf16."""
    d = tmp_path_factory.mktemp("lw")
    hf_model(make_tiny_model("qwen3_moe", d / "f32")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    return str(d / "bf16")


def _prompt(n: int, seed: int = 4) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Every expert on the "GPU" (torch backend): prompt logits, greedy tokens, and the prompt's
    per-layer routing counts (recorded during the scoring pass only)."""
    stats = tmp_path_factory.mktemp("stats") / "dist.json"
    llm = LLM(model, device="cpu", progress=False, record_expert_distribution=str(stats))
    prompt = _prompt(50)
    logits = llm.prompt_logits(prompt)
    counts = {k: v.clone() for k, v in llm.engine.runner.recorder.counts.items()}
    for b in llm.engine.runner.model.moe_blocks():  # stop recording: unwrap the recording backend
        b.experts = b.experts.inner
    tokens = llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    short = _prompt(10, seed=7)
    short_tokens = llm.generate(input_ids=short, sampling_params=GREEDY)["output_ids"]
    return {"prompt": prompt, "logits": logits, "tokens": tokens, "counts": counts, "short": short,
            "short_tokens": short_tokens}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _plan(llm: LLM) -> HybridRuntime:
    return llm.engine.runner.hybrid


def _masks(llm: LLM) -> dict[int, torch.Tensor]:
    """Each hybrid layer's current GPU mask (the dynamic update changes them)."""
    return {b.layer_idx: b.experts.mask for b in llm.engine.runner.model.moe_blocks()}


# ---- (a) device-agnostic dequantization == quant.py's reference -----------------------------------
CASES = [("AMXINT8", 128, True), ("BF16", 128, True), ("FP8", 32, True), ("FP8", 128, True)] + [
    ("AMXINT4", g, sym) for g in (32, 64, 128) for sym in (True, False)]


@pytest.mark.parametrize("method,group,sym", CASES)
@pytest.mark.parametrize("hidden,inter", [(72, 40), (128, 64)])
def test_dequantize_matches_reference(method, group, sym, hidden, inter, monkeypatch):
    g = torch.Generator().manual_seed(1)
    p = pack_layer(torch.randn(5, 2 * inter, hidden, generator=g), torch.randn(5, hidden, inter, generator=g),
                   method, group_size=group, symmetric=sym)
    ref_gu, ref_dn = p.dequantized()  # fp32
    for chunk in (dequant.DEQUANT_CHUNK_ELEMS, 2 * p.inter_pad * p.hidden_pad * 2):  # one pass; 2 experts a pass
        monkeypatch.setattr(dequant, "DEQUANT_CHUNK_ELEMS", chunk)
        gu, dn = dequant.dequantize_layer(p, "cpu", torch.float32)
        assert torch.equal(gu, ref_gu) and torch.equal(dn, ref_dn)  # bit for bit
        gu, dn = dequant.dequantize_layer(p, "cpu", torch.bfloat16)
        assert torch.equal(gu, ref_gu.bfloat16()) and torch.equal(dn, ref_dn.bfloat16())  # one rounding


def test_stream_runs():
    m = torch.tensor([True, False, False, True, False, True, False, False])
    assert layerwise.stream_runs(m, full_layer=False) == [(0, 0, 5)]
    assert layerwise.stream_runs(m, full_layer=True) == [(1, 0, 2), (4, 2, 1), (6, 3, 2)]


def _layer_setup(method: str, n_gpu_ids: list[int]):
    g = torch.Generator().manual_seed(0)
    e, h, i = 12, 72, 40
    w = ExpertWeights((torch.randn(e, 2 * i, h, generator=g) * 0.2).bfloat16().float(),
                      (torch.randn(e, h, i, generator=g) * 0.2).bfloat16().float())
    mask = torch.zeros(e, dtype=torch.bool)
    mask[n_gpu_ids] = True
    plan = HybridRuntime(HybridPlacement({0: mask}, (0,), 0, "torch", prefill_threshold=1), torch.device("cpu"), None)
    opts = ExpertsOptions(hybrid=HybridConfig(method=method, group_size=32, int4_symmetric=False), runtime=plan)
    layer = HybridExperts(w, 0, opts)
    plan.attach({0: layer})
    return plan, layer, w, mask


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "FP8"])
def test_layerwise_layer_uses_the_dequantized_weights(method):
    """One layer: the streamed experts are exactly the packed weights dequantized (checked against
    a torch reference holding those weights), the resident ones the original weights."""
    plan, layer, w, mask = _layer_setup(method, [2, 3, 8, 11])
    g = torch.Generator().manual_seed(1)
    t, k = 40, 4
    x = torch.randn(t, 72, generator=g)
    ids = torch.stack([torch.randperm(12, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    dq_gu, dq_dn = layer.cpu.layer.packed.dequantized()  # [Ec, ...] fp32, CPU-resident experts in order
    mixed = ExpertWeights(w.gate_up.clone(), w.down.clone())
    mixed.gate_up[~mask], mixed.down[~mask] = dq_gu, dq_dn
    with plan.forward_scope(t):
        out = layer.forward(x, ids, wts)
    assert _rel(out, TorchExperts(mixed).forward(x, ids, wts)) < 1e-6
    assert plan.layerwise.num_forwards == 1


def test_page_lock_registers_each_page_once(monkeypatch):
    """With a fake driver: pages shared by two layers' tensors are registered once, ranges are
    unregistered when their owner goes, a failure warns and says False."""
    calls: list[tuple[str, int, int]] = []

    class FakeDriver:
        fail = 0

        def cuMemHostRegister_v2(self, p, n, flags):  # noqa: N802 (the driver's name)
            calls.append(("reg", p.value, n))
            return self.fail

        def cuMemHostUnregister(self, p):  # noqa: N802
            calls.append(("unreg", p.value, 0))
            return 0

    drv = FakeDriver()
    monkeypatch.setattr(cuda_driver, "libcuda", lambda: drv)
    monkeypatch.setattr(cuda_driver, "_locked", [])
    page = cuda_driver.mmap.PAGESIZE
    buf = torch.empty(8 * page, dtype=torch.uint8)
    base = -(-buf.data_ptr() // page) * page - buf.data_ptr()  # offset of the first page boundary

    class Owner:
        pass

    a, b = Owner(), Owner()
    t1, t2 = buf[base:base + page + 10], buf[base + page + 20:base + 3 * page]  # share page 1
    assert cuda_driver.page_lock(a, [t1, t2], torch.device("cpu"))
    p0 = buf.data_ptr() + base
    assert calls == [("reg", p0, 3 * page)]
    t3 = buf[base + 2 * page + 5:base + 5 * page]  # overlaps page 2 (already registered)
    assert cuda_driver.page_lock(b, [t3], torch.device("cpu"))
    assert calls[1:] == [("reg", p0 + 3 * page, 2 * page)]
    assert cuda_driver.page_lock(b, [t1], torch.device("cpu")) and len(calls) == 2  # nothing new
    del a
    assert calls[2] == ("unreg", p0, 0) and cuda_driver._locked == [(p0 + 3 * page, p0 + 5 * page)]
    drv.fail = 1
    assert not cuda_driver.page_lock(Owner(), [buf[base + 6 * page:base + 7 * page]], torch.device("cpu"))


# ---- (b) threshold below the prompt length ------------------------------------------------------
@pytest.mark.parametrize("n_gpu", [0, 4, 10])
def test_layerwise_matches_all_on_gpu(model, reference, n_gpu):
    llm = LLM(model, kt_num_gpu_experts=n_gpu, kt_gpu_prefill_token_threshold=16, **BASE)
    lw = _plan(llm).layerwise
    assert _rel(llm.prompt_logits(reference["prompt"]), reference["logits"]) < 1e-5
    assert lw.num_forwards == 1
    assert llm.generate(input_ids=reference["prompt"], sampling_params=GREEDY)["output_ids"] == reference["tokens"]
    assert lw.num_forwards == 2  # the prefill; decode steps are not layerwise
    streamed = [b.experts for b in llm.engine.runner.model.moe_blocks() if b.experts.cpu is not None]
    assert len(streamed) == (0 if n_gpu == 10 else 2)
    if streamed:
        assert lw.buffer.gate_up.shape == (10 - n_gpu, 80, 72)  # [Ec, 2I, H]


def test_layerwise_amxint8(model, reference):
    """Streamed AMXINT8 experts: the int8 weights dequantized, fp32 activations."""
    args = dict(BASE, kt_method="AMXINT8", kt_num_gpu_experts=4)
    plain = LLM(model, **args).prompt_logits(reference["prompt"])  # the CPU engine (int8 activations too)
    lw_logits = LLM(model, kt_gpu_prefill_token_threshold=16, **args).prompt_logits(reference["prompt"])
    assert _rel(lw_logits, reference["logits"]) < 5e-2
    assert _rel(lw_logits, plain) < 5e-2
    assert not torch.equal(lw_logits, plain)  # another path than the CPU engine's


# ---- (c) below the threshold: unchanged; mixed lengths; chunked prefill ---------------------------
def test_threshold_above_the_prompt_changes_nothing(model, reference):
    split = LLM(model, kt_num_gpu_experts=4, **BASE)
    llm = LLM(model, kt_num_gpu_experts=4, kt_gpu_prefill_token_threshold=51, **BASE)
    assert torch.equal(llm.prompt_logits(reference["prompt"]), split.prompt_logits(reference["prompt"]))
    assert llm.generate(input_ids=reference["prompt"], sampling_params=GREEDY)["output_ids"] == reference["tokens"]
    assert _plan(llm).layerwise.num_forwards == 0


def test_short_and_long_prompts_in_one_run(model, reference):
    llm = LLM(model, kt_num_gpu_experts=4, kt_gpu_prefill_token_threshold=30, disable_radix_cache=True, **BASE)
    lw = _plan(llm).layerwise
    long, short = reference["prompt"], reference["short"]
    assert llm.generate(input_ids=short, sampling_params=GREEDY)["output_ids"] == reference["short_tokens"]
    assert lw.num_forwards == 0
    assert llm.generate(input_ids=long, sampling_params=GREEDY)["output_ids"] == reference["tokens"]
    assert lw.num_forwards == 1
    assert llm.generate(input_ids=short, sampling_params=GREEDY)["output_ids"] == reference["short_tokens"]
    assert lw.num_forwards == 1
    outs = llm.generate(input_ids=[short, long], sampling_params=GREEDY)  # one prefill batch of 60 tokens
    assert [o["output_ids"] for o in outs] == [reference["short_tokens"], reference["tokens"]]
    assert lw.num_forwards == 2


def test_chunked_prefill(model, reference):
    """Chunks of 16 + the 2-token rest: the three full chunks are layerwise, the rest is not."""
    llm = LLM(model, kt_num_gpu_experts=4, kt_gpu_prefill_token_threshold=16, chunked_prefill_size=16, **BASE)
    assert llm.generate(input_ids=reference["prompt"], sampling_params=GREEDY)["output_ids"] == reference["tokens"]
    assert _plan(llm).layerwise.num_forwards == 3


# ---- (d) deferral ---------------------------------------------------------------------------------
def test_layerwise_defers_nothing(model, reference):
    llm = LLM(model, kt_num_gpu_experts=2, kt_max_deferred_experts_per_token=1, kt_gpu_prefill_token_threshold=16,
              **BASE)
    assert _rel(llm.prompt_logits(reference["prompt"]), reference["logits"]) < 1e-5  # no deferral in it
    out = llm.generate(input_ids=reference["prompt"], sampling_params=GREEDY)["output_ids"]
    assert out[0] == reference["tokens"][0]  # sampled from the layerwise prefill; decode defers
    assert _plan(llm).pending is None


def test_layerwise_collects_work_deferred_by_an_interrupted_forward():
    g = torch.Generator().manual_seed(0)
    e, h, i, k, t = 12, 40, 24, 4, 9
    ws = [ExpertWeights((torch.randn(e, 2 * i, h, generator=g) * 0.2).bfloat16().float(),
                        (torch.randn(e, h, i, generator=g) * 0.2).bfloat16().float()) for _ in range(2)]
    mask = torch.zeros(e, dtype=torch.bool)
    mask[[1, 5, 7]] = True
    plan = HybridRuntime(HybridPlacement({0: mask, 3: mask.clone()}, (0, 3), 2, "torch", prefill_threshold=8),
                         torch.device("cpu"), None)
    opts = ExpertsOptions(hybrid=HybridConfig(method="BF16"), runtime=plan)
    layers = [HybridExperts(w, layer, opts) for w, layer in zip(ws, (0, 3))]
    plan.attach(dict(zip((0, 3), layers)))
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    layers[0].forward(x, ids, wts)  # a forward that stops after the first layer: deferred work pending
    assert plan.pending is not None
    with plan.forward_scope(t) as on:
        assert on and plan.pending is None  # collected (and dropped) first
        outs = [lay.forward(x, ids, wts) for lay in layers]
    for out, w in zip(outs, ws):
        assert _rel(out, TorchExperts(w).forward(x, ids, wts)) < 1e-5
    assert plan.pending is None and not plan.layerwise_active


# ---- (e) dynamic expert update ---------------------------------------------------------------------
def test_dynamic_update(model, reference, caplog):
    llm = LLM(model, kt_num_gpu_experts=3, kt_gpu_prefill_token_threshold=16, kt_enable_dynamic_expert_update=True,
              disable_radix_cache=True, **BASE)
    plan = _plan(llm)
    blocks = {b.layer_idx: b.experts for b in llm.engine.runner.model.moe_blocks()}
    assert all(lay.cpu.layer.packed.num_experts == 10 for lay in blocks.values())  # the CPU holds every expert
    before = {k: m.clone() for k, m in _masks(llm).items()}
    with caplog.at_level(logging.INFO):
        out = llm.generate(input_ids=reference["prompt"], sampling_params=GREEDY)["output_ids"]
    assert out == reference["tokens"]  # the prefill moved experts; decode math is the same
    swaps = plan.layerwise.last_swaps
    assert swaps and sum(len(v) for v in swaps.values()) == plan.layerwise.total_swaps
    assert sum("dynamic expert update" in r.message for r in caplog.records) == 1  # one line per prefill
    for layer, moved in swaps.items():
        counts = reference["counts"][layer]
        for e_in, e_out, c_in, c_out in moved:
            assert not before[layer][e_in] and before[layer][e_out]
            assert c_in == counts[e_in] and c_out == counts[e_out] and c_in > c_out
    for layer, m in _masks(llm).items():
        lay, counts = blocks[layer], reference["counts"][layer]
        assert int(m.sum()) == 3 and lay.gpu_w.gate_up.shape[0] == 3  # as many GPU experts as before
        assert counts[m].min() >= counts[~m].max()  # the GPU now holds the prompt's most-used experts
        assert torch.equal(lay.mask_dev, m)
        assert sorted(lay.gpu_local[m].tolist()) == [0, 1, 2] and (lay.gpu_local[~m] == -1).all()
        assert lay.cpu_local.tolist() == [-1 if on else e for e, on in enumerate(m.tolist())]
        assert lay.stream_local[~m].tolist() == list(range(7)) and (lay.stream_local[m] == -1).all()
        assert lay.runs == layerwise.stream_runs(m, full_layer=True)
    assert any(not torch.equal(before[k], _masks(llm)[k]) for k in before)
    # the moved experts' weights: each GPU slot holds its expert's checkpoint weights
    ref_blocks = {b.layer_idx: b.experts for b in LLM(model, device="cpu", progress=False).engine.runner.model
                  .moe_blocks()}
    for layer, lay in blocks.items():
        on = _masks(llm)[layer].nonzero().flatten()
        assert torch.equal(lay.gpu_w.gate_up[lay.gpu_local[on].long()], ref_blocks[layer].w.gate_up[on])
        assert torch.equal(lay.gpu_w.down[lay.gpu_local[on].long()], ref_blocks[layer].w.down[on])
    # later work, short (CPU engine path with evicted experts) and long, still gives the reference
    assert llm.generate(input_ids=reference["short"], sampling_params=GREEDY)["output_ids"] == \
        reference["short_tokens"]
    assert _rel(llm.prompt_logits(reference["prompt"]), reference["logits"]) < 1e-5
    assert plan.layerwise.last_swaps == {}  # the GPU already holds this prompt's most-used experts
    got = _router_counts(llm, reference["prompt"])  # the helper of the CUDA test: the same routing
    assert all(torch.equal(got[k], reference["counts"][k]) for k in got)


# ---- (f) options ----------------------------------------------------------------------------------
def test_flags_need_a_split(model):
    for opts in ({"kt_gpu_prefill_token_threshold": 16}, {"kt_enable_dynamic_expert_update": True},
                 {"kt_gpu_prefill_token_threshold": 16, "kt_enable_dynamic_expert_update": True}):
        with pytest.raises(ConfigError, match="needs a GPU/CPU expert split: set --kt-num-gpu-experts"):
            LLM(model, **BASE, **opts)
    with pytest.raises(ConfigError, match="needs --kt-gpu-prefill-token-threshold"):
        LLM(model, kt_num_gpu_experts=2, kt_enable_dynamic_expert_update=True, **BASE)
    with pytest.raises(ConfigError, match="kt-gpu-prefill-token-threshold"):
        LLM(model, kt_num_gpu_experts=2, kt_gpu_prefill_token_threshold=0, **BASE)


def test_memory_plan_lines(model, caplog):
    from hybridmoe.models.registry import arch_spec
    from hybridmoe.moe.memory_plan import plan_memory
    from hybridmoe.moe.placement import place_experts
    from hybridmoe.weights.loader import load_hf_config

    with caplog.at_level(logging.INFO):
        LLM(model, kt_num_gpu_experts=4, kt_gpu_prefill_token_threshold=16, kt_enable_dynamic_expert_update=True,
            **BASE)
    assert any("GPU memory plan" in r.message and "prefill buffers" in r.message for r in caplog.records)
    assert any("host memory plan" in r.message and "CPU experts (all of them" in r.message for r in caplog.records)
    cfg = load_hf_config(model)
    spec = arch_spec(cfg)
    masks = place_experts("uniform", list(spec.moe_layers), 10, 4)
    per_expert = 3 * 72 * 40
    plain = plan_memory(cfg, spec, masks, 2, "AMXINT8", 1024, 8)
    assert "prefill buffers" not in plain.gpu
    lw = plan_memory(cfg, spec, masks, 2, "AMXINT8", 1024, 8, prefill_threshold=512, dynamic_update=True)
    buf = 6 * per_expert * (2 + 2 * (1 + 4 / 2048))  # 6 streamed experts: bf16 buffer + 2 int8 staging slots
    temps = 6 * 80 * 72 * (2 + 4)
    assert abs(lw.gpu["prefill buffers"] - buf - temps) < 2
    assert abs(lw.host["CPU experts (all of them: dynamic expert update)"] - 2 * 10 * per_expert) < 2 * 10 * per_expert * 0.01


# ---- on a GPU (the lead's H200) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("method,n_gpu", [("BF16", 0), ("BF16", 4), ("BF16", 10), ("AMXINT8", 4)])
def test_layerwise_on_cuda(model, method, n_gpu):
    """(b) on CUDA: bf16 model, Triton experts, copy stream + events, page-locked CPU weights.
    Tolerance: the GPU sums in bf16 (two expert calls, each rounded to bf16): logits < 3e-2 relative
    of the all-on-GPU model (as test_hybrid.py's CUDA split test; 5e-2 for AMXINT8), and the same
    greedy tokens with BF16."""
    opts = dict(device="cuda", dtype="bfloat16", progress=False, max_total_tokens=4096, cuda_graph_max_bs=4)
    tol = 3e-2 if method == "BF16" else 5e-2
    prompt = _prompt(50)
    ref = LLM(model, **opts)
    ref_logits = ref.prompt_logits(prompt)
    ref_tokens = ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    del ref
    llm = LLM(model, kt_method=method, kt_num_gpu_experts=n_gpu, kt_gpu_prefill_token_threshold=16, **opts)
    for b in llm.engine.runner.model.moe_blocks():
        if b.experts.cpu is not None:
            assert b.experts.pinned and all(cuda_driver.is_page_locked(t) for t in b.experts.packed_parts.values())
    assert _rel(llm.prompt_logits(prompt), ref_logits) < tol
    out = llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    if method == "BF16":
        assert out == ref_tokens
    assert _plan(llm).layerwise.num_forwards == 2
    for _ in range(3):  # repeated prefills reuse the buffers, the copy stream and its events
        assert _rel(llm.prompt_logits(prompt), ref_logits) < tol


def _router_counts(llm: LLM, prompt: list[int]) -> dict[int, torch.Tensor]:
    """Scores the prompt (a layerwise prefill, so a dynamic update) and returns each MoE layer's
    expert counts from the model's own router outputs (read through forward hooks)."""
    blocks = llm.engine.runner.model.moe_blocks()
    logits: dict[int, torch.Tensor] = {}
    hooks = [getattr(b, b.gate_name).register_forward_hook(
        lambda _m, _i, out, idx=b.layer_idx: logits.__setitem__(idx, out.float())) for b in blocks]
    try:
        llm.prompt_logits(prompt)
    finally:
        for h in hooks:
            h.remove()
    return {b.layer_idx: torch.bincount(logits[b.layer_idx].topk(b.top_k).indices.flatten(),
                                        minlength=b.num_experts).cpu() for b in blocks}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_dynamic_update_on_cuda(model, graphs):
    """(e) on CUDA: after the update, decode (in CUDA graphs captured before it, when on) reads the
    swapped weights and index tensors in place and gives the all-on-GPU greedy tokens."""
    opts = dict(device="cuda", dtype="bfloat16", progress=False, max_total_tokens=4096, cuda_graph_max_bs=4,
                disable_radix_cache=True)
    prompt, short = _prompt(50), _prompt(10, seed=7)
    ref = LLM(model, **opts)
    ref_tokens = ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    ref_short = ref.generate(input_ids=short, sampling_params=GREEDY)["output_ids"]
    del ref
    llm = LLM(model, kt_method="BF16", kt_num_gpu_experts=3, kt_gpu_prefill_token_threshold=16,
              kt_enable_dynamic_expert_update=True, disable_cuda_graph=not graphs, **opts)
    assert (llm.engine.runner.graphs is not None) == graphs
    plan = _plan(llm)
    before = {k: m.clone() for k, m in _masks(llm).items()}
    counts = _router_counts(llm, prompt)
    assert plan.layerwise.last_swaps
    for layer, moved in plan.layerwise.last_swaps.items():
        for e_in, e_out, c_in, c_out in moved:
            assert not before[layer][e_in] and before[layer][e_out]
            assert c_in == counts[layer][e_in] and c_out == counts[layer][e_out] and c_in > c_out
    for layer, m in _masks(llm).items():
        assert int(m.sum()) == 3 and counts[layer][m].min() >= counts[layer][~m].max()
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    assert llm.generate(input_ids=short, sampling_params=GREEDY)["output_ids"] == ref_short
    batch = [prompt[: 10 + 7 * i] for i in range(3)]
    outs = [o["output_ids"] for o in llm.generate(input_ids=batch, sampling_params=GREEDY)]
    assert outs == [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in batch]
