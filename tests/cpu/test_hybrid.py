"""Hybrid experts with `--device cpu`: both sides on the CPU (the "GPU" side is the torch backend),
the same layer code as on a GPU machine. Placement, deferral, the expert distribution file."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from stream_emulation import emulate_stream

from hybridmoe import LLM
from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.moe.placement import gpu_expert_counts, gpu_experts_per_layer, place_experts

from tiny_models import hf_model, make_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Tiny Qwen3-MoE (10 experts, top-3, MoE layers 0 and 2) stored in bf16, so the CPU BF16
    method holds exactly the checkpoint's weights."""
    d = tmp_path_factory.mktemp("hyb")
    hf_model(make_tiny_model("qwen3_moe", d / "f32")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    return d / "bf16"


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(str(model), device="cpu", progress=False)  # every expert on the "GPU" side (torch)
    prompt = torch.randint(0, 211, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    return prompt, llm.prompt_logits(prompt), llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def stats_file(model, reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "dist.json"
    llm = LLM(str(model), device="cpu", progress=False, record_expert_distribution=str(path))
    llm.generate(input_ids=reference[0], sampling_params=GREEDY)
    llm.shutdown()
    return path


@pytest.mark.parametrize("strategy", ["uniform", "front-loading", "random", "frequency"])
@pytest.mark.parametrize("n_gpu", [0, 1, 4, 9, 10])
def test_split_matches_all_on_gpu(model, reference, stats_file, strategy, n_gpu):
    """Tolerance: BF16 CPU experts hold the same bf16 weights; the kernel accumulates in fp32 in
    another order, so logits agree to ~1e-6 relative (asserted < 1e-5) and greedy tokens are equal."""
    prompt, ref_logits, ref_tokens = reference
    llm = LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=n_gpu,
              kt_expert_placement_strategy=strategy, init_expert_location=str(stats_file))
    # 0 GPU experts: the plain CPU backend; 10 of 10: a hybrid layer with an empty CPU side
    assert {b.experts.name for b in llm.engine.runner.model.moe_blocks()} == {"cpu" if n_gpu == 0 else "hybrid"}
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 1e-5
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens


def test_placement_strategies():
    layers = [0, 2, 3]
    uni = place_experts("uniform", layers, 8, 3)
    assert all(m.tolist() == [True] * 3 + [False] * 5 for m in uni.values())
    front = place_experts("front-loading", layers, 8, 3)  # 9 in all: 8 in layer 0, 1 in layer 2
    assert [int(front[i].sum()) for i in layers] == [8, 1, 0]
    rnd, rnd2 = place_experts("random", layers, 8, 3, seed=1), place_experts("random", layers, 8, 3, seed=1)
    assert all(int(m.sum()) == 3 and torch.equal(m, rnd2[i]) for i, m in rnd.items())


def test_frequency_uses_the_recorded_counts(stats_file):
    data = json.loads(stats_file.read_text())
    assert data["num_experts"] == 10 and sorted(data["counts"]) == ["0", "2"]
    counts = data["counts"]["2"]
    assert sum(counts) == 3 * (50 + 23)  # top-3 for the prompt and each decoded token but the last
    masks = place_experts("frequency", [0, 2], 10, 3, str(stats_file))
    top = sorted(range(10), key=lambda e: (-counts[e], e))[:3]
    assert masks[2].nonzero().flatten().tolist() == sorted(top)


def _gpu_experts(llm) -> dict[int, list[int]]:
    """The GPU side's experts of each MoE layer, as placed at startup."""
    return {layer: m.nonzero().flatten().tolist() for layer, m in llm.engine.runner.moe.placement.masks.items()}


def test_frequency_from_an_sglang_record(model, stats_file, tmp_path):
    """SGLang's stat-mode record (/dump_expert_distribution_record: a .pt of logical_count [forward passes, every
    layer, experts], the dense layer 1's row all zeros) places the experts that hybridmoe's file of the same counts
    places; a count in the dense layer is another model's record."""
    counts = json.loads(stats_file.read_text())["counts"]
    rows = torch.zeros(2, 3, 10, dtype=torch.int32)  # two forward passes, 3 layers
    rows[0, 0], rows[1, 2] = torch.tensor(counts["0"]), torch.tensor(counts["2"])
    record = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": rows, "average_utilization_rate_over_window": None}, record)
    opts = dict(device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3,
                kt_expert_placement_strategy="frequency")
    ours = _gpu_experts(LLM(str(model), init_expert_location=str(stats_file), **opts))
    assert _gpu_experts(LLM(str(model), init_expert_location=str(record), **opts)) == ours
    assert [len(ours[layer]) for layer in (0, 2)] == [3, 3]
    rows[0, 1, 4] = 1
    torch.save({"logical_count": rows}, record)
    with pytest.raises(ConfigError, match="counts for layer 1, which is not a MoE layer of the model"):
        LLM(str(model), init_expert_location=str(record), **opts)


@pytest.mark.parametrize(("experts", "layers", "count", "ratio", "want"), [
    (10, 2, None, 0.0, [0, 0]),
    (10, 2, None, 1.0, [10, 10]),
    (10, 2, None, 0.3, [3, 3]),
    (10, 2, None, 0.25, [3, 2]),  # 5 in all: the first layer takes the remainder
    (8, 4, None, 0.3, [3, 2, 2, 2]),  # 9.6 in all: 9 (rounded down, as SGLang's kt wrapper does)
    (10, 2, None, 0.04, [0, 0]),  # 0.8 in all: none
    (10, 2, None, 0.05, [1, 0]),  # 1 in all (per layer it was round(0.5) = 0: none)
    (8, 1, None, 0.4375, [3]),  # 3.5: 3 (round() gave 4 here but 2 for 2.5)
    (100, 1, None, 0.29, [29]),  # 0.29 * 100 is 28.999999999999996 in floats
    (10, 2, 7, None, [7, 7]),
    (10, 2, 0, None, [0, 0]),
    (10, 2, 12, None, [10, 10]),  # above the experts: all of them
    (10, 2, 7, 0.25, [3, 2]),  # both: the ratio wins, as in SGLang's kt wrapper (the count used to win)
    (10, 2, 0, 1.0, [10, 10]),
])
def test_gpu_experts_ratio_counts(experts, layers, count, ratio, want):
    assert gpu_expert_counts(experts, layers, count, ratio) == want
    assert gpu_experts_per_layer(experts, count, ratio, layers) == max(want)
    for strategy in ("uniform", "random", "front-loading"):
        masks = place_experts(strategy, list(range(layers)), experts, want)
        assert sum(int(m.sum()) for m in masks.values()) == sum(want)
        if strategy != "front-loading":
            assert [int(m.sum()) for m in masks.values()] == want


def test_gpu_experts_ratio_in_the_model(model, reference, caplog):
    prompt, ref_logits, ref_tokens = reference
    opts = dict(device="cpu", progress=False, kt_method="BF16")
    with caplog.at_level(logging.WARNING, logger="hybridmoe.moe.placement"):
        llm = LLM(str(model), kt_gpu_experts_ratio=0.25, kt_num_gpu_experts=7, **opts)
    assert _gpu_experts(llm) == {0: [0, 1, 2], 2: [0, 1]}  # 5 of the 2 x 10 (uniform)
    assert "--kt-gpu-experts-ratio 0.25 is set: --kt-num-gpu-experts 7 is ignored" in caplog.text
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 1e-5
    one = LLM(str(model), kt_gpu_experts_ratio=1.0, **opts)
    assert _gpu_experts(one) == {0: list(range(10)), 2: list(range(10))}
    zero = LLM(str(model), kt_gpu_experts_ratio=0.0, **opts)  # every expert on the CPU engine
    assert zero.engine.runner.moe.placement is None
    assert {b.experts.name for b in zero.engine.runner.model.moe_blocks()} == {"cpu"}
    assert zero.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens


def test_plans_count_the_ratio_as_the_placement_does(model):
    """The memory plans before the load (sizing.py: whether there is a hybrid plan; lora/plan.py: the GPU side's
    LoRA slots) count the experts the placement puts on the GPU."""
    from hybridmoe.lora.plan import _gpu_side_experts
    from hybridmoe.sizing import hybrid_plan_applies

    spec = SimpleNamespace(num_experts=10, moe_layers=(0, 2))
    for ratio, n in ((0.04, 0), (0.05, 1), (0.25, 5), (1.0, 20)):
        args = EngineArgs(model_path=str(model), device="cpu", kt_gpu_experts_ratio=ratio, kt_num_gpu_experts=7)
        assert hybrid_plan_applies(args, spec, "cpu") == (n > 0)
        assert _gpu_side_experts(args, spec, "cpu") == n


def test_deferral_in_the_model(model, reference):
    prompt, ref_logits, _ = reference
    for d in (1, 2):
        llm = LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=2,
                  kt_max_deferred_experts_per_token=d)
        assert [b.experts.defer for b in llm.engine.runner.model.moe_blocks()] == [d, 0]  # the last defers nothing
        assert _rel(llm.prompt_logits(prompt), ref_logits) > 1e-3  # deferral changes the result...
        assert llm.engine.runner.hybrid.pending is None  # ...and the last layer collected the deferred work


def test_set_num_deferred_switches_a_loaded_model(model, reference):
    """Changing the deferral of a loaded model (benchmarks) gives what a model built with it gives."""
    prompt, ref_logits, _ = reference
    built = LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=2,
                kt_max_deferred_experts_per_token=1).prompt_logits(prompt)
    llm = LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=2)
    plan = llm.engine.runner.hybrid
    plan.set_num_deferred(1)
    assert [b.experts.defer for b in llm.engine.runner.model.moe_blocks()] == [1, 0]
    assert _rel(llm.prompt_logits(prompt), built) < 1e-6
    plan.set_num_deferred(0)
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 1e-5


def test_deferral_semantics_exact():
    """Two MoE layers: layer A's `d` lowest-weight CPU experts per token are left out of A's output
    and added to layer B's, exactly."""
    from hybridmoe.config import HybridConfig
    from hybridmoe.moe.experts import ExpertWeights
    from hybridmoe.moe.hybrid import HybridExperts
    from hybridmoe.moe.options import ExpertsOptions
    from hybridmoe.moe.placement import HybridPlacement
    from hybridmoe.moe.runtime import HybridRuntime
    from hybridmoe.moe.torch_experts import TorchExperts

    g = torch.Generator().manual_seed(0)
    e, h, i, k, t, d = 12, 40, 24, 4, 9, 2
    ws = [ExpertWeights((torch.randn(e, 2 * i, h, generator=g) * 0.2).bfloat16().float(),
                        (torch.randn(e, h, i, generator=g) * 0.2).bfloat16().float()) for _ in range(2)]
    mask = torch.zeros(e, dtype=torch.bool)
    mask[[1, 5, 7]] = True
    rt = HybridRuntime(HybridPlacement({0: mask, 3: mask}, (0, 3), d, "torch"), torch.device("cpu"), None)
    opts = ExpertsOptions(hybrid=HybridConfig(method="BF16"), runtime=rt)
    layers = [HybridExperts(w, layer, opts) for w, layer in zip(ws, (0, 3))]
    xs = [torch.randn(t, h, generator=g) for _ in range(2)]
    ids = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) for _ in range(2)]
    wts = [torch.rand(t, k, generator=g) for _ in range(2)]
    out_a = layers[0].forward(xs[0], ids[0], wts[0])
    out_b = layers[1].forward(xs[1], ids[1], wts[1])
    # reference: which pairs of layer A are deferred
    on_cpu = ~mask[ids[0]]
    order = torch.where(on_cpu, wts[0], float("inf")).argsort(dim=1, stable=True)
    later = torch.zeros_like(on_cpu).scatter_(1, order[:, :d], True) & on_cpu
    ref = [TorchExperts(w) for w in ws]
    ref_a = ref[0].forward(xs[0], ids[0], torch.where(later, 0.0, wts[0]))
    ref_b = ref[1].forward(xs[1], ids[1], wts[1]) + ref[0].forward(xs[0], ids[0], torch.where(later, wts[0], 0.0))
    assert later.any() and _rel(out_a, ref_a) < 1e-5 and _rel(out_b, ref_b) < 1e-5
    assert rt.pending is None


def test_bad_hybrid_options(model, tmp_path):
    with pytest.raises(ConfigError, match="init-expert-location"):
        LLM(str(model), device="cpu", progress=False, kt_num_gpu_experts=2, kt_expert_placement_strategy="frequency")
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="not an expert distribution"):
        LLM(str(model), device="cpu", progress=False, kt_num_gpu_experts=2, kt_expert_placement_strategy="frequency",
            init_expert_location=str(bad))
    with pytest.raises(ConfigError, match="needs a GPU/CPU expert split"):  # the layerwise prefill: test_layerwise.py
        LLM(str(model), device="cpu", progress=False, kt_gpu_prefill_token_threshold=1024)


def test_memory_plan_is_printed_and_a_plan_that_does_not_fit_is_refused(model, caplog):
    import logging

    from hybridmoe.models.registry import arch_spec
    from hybridmoe.moe.memory_plan import GiB, check_fits, plan_memory
    from hybridmoe.weights.loader import load_hf_config

    with caplog.at_level(logging.INFO):
        LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=4)
    assert any("GPU memory plan" in r.message and "GPU experts" in r.message for r in caplog.records)
    assert any("host memory plan" in r.message and "CPU experts" in r.message for r in caplog.records)
    cfg = load_hf_config(str(model))
    spec = arch_spec(cfg)
    masks = place_experts("uniform", list(spec.moe_layers), 10, 4)
    plan = plan_memory(cfg, spec, masks, 2, "AMXINT8", 1024, 8)
    per_expert = 3 * 72 * 40
    assert plan.gpu["GPU experts"] == 2 * 4 * per_expert * 2  # 2 MoE layers x 4 experts, bf16
    assert abs(plan.host["CPU experts"] - 2 * 6 * per_expert) < 2 * 6 * per_expert * 0.01  # int8: ~1 byte
    assert check_fits(plan, 100 * GiB, 100 * GiB, per_expert * 2, 2, 4) is None
    need = sum(plan.gpu.values())
    msg = check_fits(plan, need - 2 * per_expert * 2 * 2, None, per_expert * 2, 2, 4)  # 2 experts per layer short
    assert msg is not None and "--kt-num-gpu-experts 2 would fit" in msg


@pytest.mark.parametrize("wait,merge", [("hostfn", False), ("memop", False), ("memop", True)])
@pytest.mark.parametrize("deferred", [0, 1, 2])
def test_stream_path_logic_on_cpu(model, monkeypatch, deferred, wait, merge):
    """The CUDA stream path's data flow (pinned buffers shared by alternating layers, the deferred
    task reading the immediate task's x and w, both queued together by gated submits, one host
    function, or memory-operation waits on done words, waiting for a layer's task and the previous
    layer's deferred one) on the CPU: host functions and memory operations run inline, as the stream
    would run them in order, and go words are set by a plain copy. Same logits (fp32) and tokens as
    the Python-driven path, batched and alone (with memop waits and merge_deferred a one-token layer's
    task and its deferred one run as one native task: the alone case)."""
    from hybridmoe.cpu.engine import default_pool
    from hybridmoe.cpu.trace import summarize
    from hybridmoe.moe import cuda_bridge

    prompt = torch.randint(0, 211, (37,), generator=torch.Generator().manual_seed(6)).tolist()
    opts = dict(device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3,
                kt_max_deferred_experts_per_token=deferred)
    ref = LLM(str(model), **opts)
    opts["hybrid_stream_wait"] = wait
    ref_logits = ref.prompt_logits(prompt)
    ref_tokens = [o["output_ids"] for o in ref.generate(input_ids=[prompt, prompt[:11]], sampling_params=GREEDY)]
    ref_alone = ref.generate(input_ids=prompt[:23], sampling_params=GREEDY)["output_ids"]
    ref.shutdown()
    emulate_stream(monkeypatch)
    calls = {"pair_submit": 0, "pair_sync": 0}
    for name in ("enqueue_submit_with", "enqueue_result_with"):
        orig = getattr(cuda_bridge.StreamCPUTask, name)

        def counted(self, *a, _orig=orig, _key="pair_submit" if "submit" in name else "pair_sync", **kw):
            calls[_key] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(cuda_bridge.StreamCPUTask, name, counted)
    llm = LLM(str(model), **opts)
    llm.engine.runner.hybrid.set_merge_deferred(merge)
    pool = default_pool()
    pool.sync()
    pool.trace_start()
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 1e-5
    trace = summarize(pool.trace_stop())  # one forward: a task per MoE layer, one more per deferring layer
    n_moe = len(llm.engine.runner.model.moe_blocks())
    assert trace["tasks"] == n_moe + (n_moe - 1 if deferred else 0), trace
    if wait == "hostfn":
        assert trace["waits"] >= n_moe and trace["releases"] >= n_moe - 1 and trace["run_us"] > 0, trace
    else:  # no host function waited: the stream polled the tasks' done words
        assert trace["waits"] == 0 and trace["run_us"] > 0, trace
        tasks = [t for layer in llm.engine.runner.hybrid.layers.values() for pair in layer._stream_tasks.values()
                 for t in pair if t is not None]
        assert tasks and all(t.done is not None and t.done.item() == 0 for t in tasks)  # each wait cleared its word
    got = [o["output_ids"] for o in llm.generate(input_ids=[prompt, prompt[:11]], sampling_params=GREEDY)]
    assert got == ref_tokens
    assert llm.generate(input_ids=prompt[:23], sampling_params=GREEDY)["output_ids"] == ref_alone
    merged = sum(len(t.merged) for layer in llm.engine.runner.hybrid.layers.values()
                 for pair in layer._stream_tasks.values() for t in pair if t is not None)
    assert (merged > 0) == (merge and deferred > 0), merged
    if deferred:  # the pair forms ran (every MoE layer but the last defers; all but the first collect)
        assert calls["pair_submit"] > 0 and calls["pair_sync"] > 0
    else:
        assert calls == {"pair_submit": 0, "pair_sync": 0}
    llm.shutdown()


def test_stream_task_failure_fails_the_step(model, monkeypatch):
    """A CPU task run from the stream cannot raise where it runs (a host function, a graph replay):
    the engine checks after the step, so the request fails with the task's message instead of
    getting tokens from stale outputs, and the next request is served normally."""
    from hybridmoe.moe import cuda_bridge

    prompt = torch.randint(0, 211, (23,), generator=torch.Generator().manual_seed(8)).tolist()
    opts = dict(device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3)
    ref = LLM(str(model), **opts)
    ref_tokens = ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    ref.shutdown()
    emulate_stream(monkeypatch)
    orig = cuda_bridge.StreamCPUTask.enqueue_submit
    state = {"n": 0, "poison_at": 5}

    def poisoned(self, x, ids, w, *rest):
        state["n"] += 1
        if state["n"] == state["poison_at"]:  # a decode step's CPU task gets an expert id out of range
            ids = ids.clone()
            ids[0, 0] = 1000
        return orig(self, x, ids, w, *rest)

    monkeypatch.setattr(cuda_bridge.StreamCPUTask, "enqueue_submit", poisoned)
    llm = LLM(str(model), **opts)
    failed = llm.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["finish_reason"]
    # the step fails its requests (an abort with the task's message), the engine keeps serving
    assert failed["type"] == "abort" and "out of range" in failed["message"] and "CPU" in failed["message"], failed
    assert llm.engine.kv.num_used() == 0 and not llm.engine.scheduler.has_work()
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("poison", ["input", "weight"])
def test_stream_task_nan_token_fails_its_request_alone(model, monkeypatch, overlap, poison):
    """On the stream path a token whose own values are non-finite (a NaN input row, an infinite routing
    weight) does not fail its task: the task writes NaN for that token (HmTask.nan_rows), the NaN reaches
    the token's logits, and the sampler fails that request alone; the other request of the batch keeps its
    tokens. Before, the task's error surfaced after the step and failed the whole batch."""
    from hybridmoe.moe import cuda_bridge

    prompts = [torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (23, 17)]
    flag = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    opts = dict(device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3, **flag)
    emulate_stream(monkeypatch)
    llm = LLM(str(model), **opts)
    ref_tokens = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]
    orig = cuda_bridge.StreamCPUTask.enqueue_submit
    state = {"poisoned": 0}

    def poisoned(self, x, ids, w, *rest):
        if x.shape[0] == 2 and not state["poisoned"]:  # the first decode step's task: row 1 is the second request
            state["poisoned"] = 1
            x, w = x.clone(), w.clone()
            if poison == "input":
                x[1, 3] = float("nan")
            else:
                w[1, 0] = float("inf")
        return orig(self, x, ids, w, *rest)

    monkeypatch.setattr(cuda_bridge.StreamCPUTask, "enqueue_submit", poisoned)
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert state["poisoned"] and reasons[0]["type"] == "length", reasons
    assert reasons[1]["type"] == "abort" and "logits for this request are NaN" in reasons[1]["message"], reasons
    assert reasons[1]["status_code"] == 500
    assert outs[0]["output_ids"] == ref_tokens[0]
    assert llm.engine.failed_requests == 1 and llm.engine.failed_batches == 0
    assert llm.engine.kv.num_used() == 0 and not llm.engine.scheduler.has_work()
    llm.shutdown()


@pytest.mark.parametrize("wait", ["hostfn", "memop"])
def test_stream_forward_interrupted_with_deferred_work(model, monkeypatch, wait):
    """A forward that fails after a layer deferred CPU work leaves it pending; the next forward
    waits for it and drops it (not added to its own first layer): same tokens as a fresh engine.
    With memory-operation waits the failed layer's own task also left its done word set: the next
    submit of that task waits for it and clears it first, so no later wait passes early."""
    from hybridmoe.moe import hybrid

    prompt = torch.randint(0, 211, (19,), generator=torch.Generator().manual_seed(9)).tolist()
    opts = dict(device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3,
                kt_max_deferred_experts_per_token=1, hybrid_stream_wait=wait)
    emulate_stream(monkeypatch)
    fresh = LLM(str(model), **opts)
    ref_tokens = fresh.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    fresh.shutdown()
    llm = LLM(str(model), **opts)
    last = llm.engine.runner.hybrid.moe_layers[-1]
    orig = hybrid.HybridExperts._gpu_part
    state = {"armed": True}

    def failing(self, x, ids, w, gpu_in=None):
        if state["armed"] and self.layer_idx == last:  # the earlier MoE layers have deferred work
            state["armed"] = False
            raise RuntimeError("injected failure")
        return orig(self, x, ids, w, gpu_in)

    monkeypatch.setattr(hybrid.HybridExperts, "_gpu_part", failing)
    failed = llm.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["finish_reason"]
    assert failed["type"] == "abort" and "injected" in failed["message"], failed
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    llm.shutdown()


def _with_short_gate_timeout(model, monkeypatch, opts: dict, prompt: list[int]):
    """(reference greedy tokens from an engine with the default pool, an engine on a dedicated pool whose gated tasks
    time out after 0.2 s, that pool): the gate-timeout tests' setup."""
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.cpu.settings import CPUEngineSettings
    from hybridmoe.moe import cpu_experts

    ref = LLM(str(model), **opts)
    ref_tokens = ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    ref.shutdown()
    pool = CPUThreadPool(2, settings=CPUEngineSettings(gate_timeout_s=0.2))
    monkeypatch.setattr(cpu_experts, "cpu_pool_for", lambda cfg: pool)
    return ref_tokens, LLM(str(model), **opts), pool


def test_a_task_skipped_at_the_gate_timeout_leaves_no_go_word(model, monkeypatch):
    """The GPU stalls past the gate timeout (CPUEngineSettings.gate_timeout_s) before it releases a layer's
    task: the pool skips the task, the step fails alone, and the go word the stream sets later is cleared
    before the error is raised (a 1 left there would start the task's next run before its inputs land).
    The next request gets the reference tokens."""
    import ctypes as C
    import threading

    from hybridmoe.moe import cuda_bridge

    prompt = torch.randint(0, 211, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    opts = dict(device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3, hybrid_stream_wait="memop")
    emulate_stream(monkeypatch)
    ref_tokens, llm, pool = _with_short_gate_timeout(model, monkeypatch, opts, prompt)
    rt = llm.engine.runner.hybrid
    stalled = {"task": None}
    real_release, real_submit = cuda_bridge.StreamCPUTask._release, cuda_bridge.GatedSubmitter.submit

    def release(self, device):  # the first task's go comes from `submit` below, late
        if stalled["task"] is None:
            stalled["task"] = self
            return
        real_release(self, device)

    def submit(self, call, go):
        real_submit(self, call, go)
        task = stalled["task"]
        if task is not None and go is task.go and not task.go.item() and not getattr(task, "_late", False):
            task._late = True
            late = threading.Timer(0.6, lambda: C.c_int32.from_address(task.go.data_ptr()).__setattr__("value", 1))
            late.start()  # the stalled GPU sets the go word well past the 0.2 s timeout
            late.join()  # stream order: the go word is set before the stream reaches the task's wait

    monkeypatch.setattr(cuda_bridge.StreamCPUTask, "_release", release)
    monkeypatch.setattr(cuda_bridge.GatedSubmitter, "submit", submit)
    failed = llm.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["finish_reason"]
    assert failed["type"] == "abort" and "gate timeout" in failed["message"], failed
    tasks = [task for layer in rt.layers.values() for task in layer.stream_tasks()]
    assert stalled["task"] in tasks and stalled["task"]._late
    assert [int(task.go.item()) for task in tasks] == [0] * len(tasks)  # no stale go word
    monkeypatch.setattr(cuda_bridge.StreamCPUTask, "_release", real_release)
    monkeypatch.setattr(cuda_bridge.GatedSubmitter, "submit", real_submit)
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    llm.shutdown()
    pool.close()


@pytest.mark.gpu
def test_a_task_skipped_at_the_gate_timeout_on_cuda(model, monkeypatch):
    """test_a_task_skipped_at_the_gate_timeout_leaves_no_go_word on a real stream: the GPU sleeps ~1 s before the
    first layer's hand-over kernel (which sets the go word), past a 0.2 s gate timeout. The step fails with the
    gate-timeout error, every go word is 0 once it is raised (the device synchronized first), and the next request
    gets the reference tokens."""
    from hybridmoe.moe import cuda_bridge

    prompt = torch.randint(0, 211, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    opts = dict(device="cuda", dtype="bfloat16", progress=False, kt_method="BF16", kt_num_gpu_experts=4,
                max_total_tokens=4096, disable_cuda_graph=True, hybrid_stream_wait="memop")
    ref_tokens, llm, pool = _with_short_gate_timeout(model, monkeypatch, opts, prompt)
    rt = llm.engine.runner.hybrid
    assert rt.fused_handoff
    real = cuda_bridge.StreamCPUTask.enqueue_handoff
    armed = {"left": 1}

    def stalled(self, *a, **k):
        if armed["left"]:
            armed["left"] -= 1
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clocks before the go word is set
        return real(self, *a, **k)

    monkeypatch.setattr(cuda_bridge.StreamCPUTask, "enqueue_handoff", stalled)
    failed = llm.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["finish_reason"]
    assert failed["type"] == "abort" and "gate timeout" in failed["message"], failed
    assert armed["left"] == 0
    tasks = [task for layer in rt.layers.values() for task in layer.stream_tasks()]
    assert tasks and [int(task.go.item()) for task in tasks] == [0] * len(tasks)  # no stale go word
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens
    llm.shutdown()
    pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("deferred", [0, 1, 2])
def test_stream_path_on_cuda(model, deferred):
    """The CPU side driven from the CUDA stream (gated submits; waits by host functions or by memory
    operations on done words) captured in decode graphs gives what the eager stream path gives: the
    same greedy tokens, single and batched (the pinned buffers shared by the layers), whichever way the
    stream waits, with the hand-over kernels (handoff_triton.py, the default) or the copies, and a replay
    queues its graph's CPU tasks first. (The eager stream path against the Python-driven one:
    test_stream_path_logic_on_cpu; a split against all experts on the GPU:
    test_split_on_cuda_matches_all_on_gpu.)"""
    prompt = torch.randint(0, 211, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    opts = dict(device="cuda", dtype="bfloat16", progress=False, kt_method="BF16", kt_num_gpu_experts=4,
                kt_max_deferred_experts_per_token=deferred, max_total_tokens=4096, cuda_graph_max_bs=4)
    batch = [prompt[: 10 + 7 * i] for i in range(3)]
    results = []
    for graphs, wait, merge, fused in ((False, "hostfn", False, True), (True, "hostfn", False, True),
                                       (False, "memop", False, True), (True, "memop", False, True),
                                       (False, "memop", True, True), (True, "memop", True, True),
                                       (True, "memop", True, False), (False, "memop", False, False),
                                       (True, "hostfn", False, False)):
        opts["hybrid_stream_wait"] = wait
        llm = LLM(str(model), disable_cuda_graph=not graphs, **opts)
        rt = llm.engine.runner.hybrid
        assert rt.fused_handoff  # the default on CUDA
        if rt.merge_deferred != merge or not fused:  # one-token tasks merged with their deferred ones (or not),
            llm.engine.runner.graphs = None  # the copies instead of the hand-over kernels: the graphs captured again
            rt.set_merge_deferred(merge)
            rt.set_fused_handoff(fused)
            if graphs:
                llm.engine.runner.capture_graphs()
        assert (llm.engine.runner.graphs is not None) == graphs
        assert llm.engine.sampler.wait_event is not None  # the step's result is read sleeping
        tokens = llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        outs = [o["output_ids"] for o in llm.generate(input_ids=batch, sampling_params=GREEDY)]
        single = [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in batch]
        assert outs == single
        if graphs:
            assert llm.engine.runner.graphs.before_replay  # the graphs' gated CPU tasks
        results.append((tokens, outs))
        llm.shutdown()
    assert all(r == results[0] for r in results[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["uniform", "front-loading", "random", "frequency"])
@pytest.mark.parametrize("n_gpu", [0, 1, 4, 9, 10])
def test_split_on_cuda_matches_all_on_gpu(model, stats_file, strategy, n_gpu):
    """On the GPU (bf16, Triton experts, stream host functions, CUDA graphs), every split gives the
    greedy tokens of the same model with every expert on the GPU. Tolerance: the GPU side sums in
    bf16 and the BF16 CPU side in fp32, so logits differ by bf16 rounding: < 3e-2 relative (as
    tests/test_parity.py's bf16 tolerance; 2.0e-2 was seen on the H200)."""
    prompt = torch.randint(0, 211, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    opts = dict(device="cuda", dtype="bfloat16", progress=False, max_total_tokens=4096, cuda_graph_max_bs=4)
    ref = LLM(str(model), **opts)
    ref_logits = ref.prompt_logits(prompt)
    ref_tokens = ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    del ref
    llm = LLM(str(model), kt_method="BF16", kt_num_gpu_experts=n_gpu, kt_expert_placement_strategy=strategy,
              init_expert_location=str(stats_file), **opts)
    assert _rel(llm.prompt_logits(prompt), ref_logits) < 3e-2
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == ref_tokens


# ---------------------------------------------------------------- DeepSeek: shared experts, grouped routing, MLA


def test_stream_wait_setting_is_checked(model):
    """--hybrid-stream-wait takes auto, memop or hostfn (one line naming it otherwise; exit 2 from the
    command line), and the runtime's switch checks its value the same way; auto is memop off CUDA (the
    stream path's emulation) and where the driver has stream memory operations."""
    with pytest.raises(ConfigError, match=r"--hybrid-stream-wait: got 'spin', expected auto, memop or hostfn"):
        LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3,
            hybrid_stream_wait="spin")
    llm = LLM(str(model), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3)
    rt = llm.engine.runner.hybrid
    assert rt.stream_wait == "memop"  # auto
    with pytest.raises(ConfigError, match="--hybrid-stream-wait: got 'poll'"):
        rt.set_stream_wait("poll")
    rt.set_stream_wait("hostfn")
    assert rt.stream_wait == "hostfn"
    llm.shutdown()
    proc = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "--model-path", str(model),
                           "--hybrid-stream-wait", "spin", "--prompt", "hi"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--hybrid-stream-wait" in proc.stderr, proc.stderr[-2000:]
