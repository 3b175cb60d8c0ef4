"""Hybrid features on GGUF experts (--kt-method LLAMAFILE) with `--device cpu` (the "GPU" side is the
torch backend, the copies plain CPU copies, the same layer code as on a GPU machine): every placement
strategy, deferral, the layerwise prefill (GGUF blocks streamed and dequantized: the torch reference
here, the Triton kernel on CUDA) with and without dynamic expert update, the memory plan.

Tolerances (the model: tests/gguf_io/conftest.py, experts Q4_K / Q6_K / Q8_0 by layer; reference: every
expert on the torch side, i.e. torch on the dequantized blocks in fp32):
  * a layerwise forward computes every expert in torch on exactly those weights (the streamed blocks
    dequantized by the reference, fp32): only the summation order differs, logits < 1e-5 relative;
  * forwards with CPU experts carry the CPU kernels' per-token Q8_K activation rounding: logits < 0.10
    relative (the bound test_gguf_model.py states for this model, measured ~7% with every expert on the CPU);
  * where GPU and CPU experts sit (strategies, swaps) is checked exactly: the CPU layer's blocks are the
    file's rows of its experts, the GPU weights their dequantized values;
  * deferral moves each token's lowest-weight CPU experts to the next MoE layer's output: layer A's plus
    layer B's outputs with deferral equal those without it to < 1e-5 (same kernels, another task split).
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM
from hybridmoe.cpu import gguf_quant as gq
from hybridmoe.gguf.reader import GGUFModel

PROMPT = torch.randint(0, 4000, (29,), generator=torch.Generator().manual_seed(5)).tolist()
SHORT = PROMPT[:10]
GREEDY = {"max_new_tokens": 6, "temperature": 0}
H, INTER, E = 256, 512, 10  # the fixture model's sizes
OPTS = dict(device="cpu", progress=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def gguf(qwen3_gguf):
    return str(qwen3_gguf[1])


@pytest.fixture(scope="module")
def reference(gguf):
    """Every expert on the torch side (dequantized blocks): the prompt's and the short prompt's logits,
    and each layer's GPU weights (= every expert dequantized)."""
    llm = LLM(gguf, kt_num_gpu_experts=E, **OPTS)
    blocks = {b.layer_idx: b.experts.gpu_w for b in llm.engine.runner.model.moe_blocks()}
    return {"logits": llm.prompt_logits(PROMPT), "short": llm.prompt_logits(SHORT), "w": blocks}


@pytest.fixture(scope="module")
def file_rows(gguf):
    """layer -> (gate, up, down) uint8 rows of the file."""
    m = GGUFModel.open(gguf)
    return {layer: tuple(m.tensor(f"blk.{layer}.ffn_{p}_exps.weight").rows() for p in ("gate", "up", "down"))
            for layer in range(3)}


@pytest.fixture(scope="module")
def stats_file(gguf, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "dist.json"
    llm = LLM(gguf, record_expert_distribution=str(path), **OPTS)
    llm.generate(input_ids=PROMPT, sampling_params=GREEDY)
    llm.shutdown()
    return path


def _blocks(llm: LLM):
    return {b.layer_idx: b.experts for b in llm.engine.runner.model.moe_blocks()}


def _check_split(llm: LLM, reference, file_rows, full_cpu_layer: bool = False) -> None:
    """Each layer: the GPU slots hold their experts' dequantized blocks, the CPU layer the file's rows."""
    for layer, lay in _blocks(llm).items():
        m = lay.mask
        on = m.nonzero().flatten()
        if len(on):
            slots = lay.gpu_local[on].long()
            assert torch.equal(lay.gpu_w.gate_up[slots], reference["w"][layer].gate_up[on])
            assert torch.equal(lay.gpu_w.down[slots], reference["w"][layer].down[on])
        if lay.cpu is None:
            assert bool(m.all())
            continue
        packed = lay.cpu.layer.packed
        for got, want in zip((packed.gate, packed.up, packed.down), file_rows[layer]):
            assert torch.equal(got, want if full_cpu_layer else want[~m])


# ---- placement strategies and deferral ------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["uniform", "front-loading", "random", "frequency"])
def test_placement_strategies_and_deferral(gguf, reference, file_rows, stats_file, strategy):
    llm = LLM(gguf, kt_num_gpu_experts=3, kt_expert_placement_strategy=strategy,
              init_expert_location=str(stats_file), **OPTS)
    masks = {k: lay.mask for k, lay in _blocks(llm).items()}
    assert sum(int(m.sum()) for m in masks.values()) == 9
    if strategy == "front-loading":
        assert [int(m.sum()) for m in masks.values()] == [9, 0, 0]
    _check_split(llm, reference, file_rows)
    plain = llm.prompt_logits(PROMPT)
    assert _rel(plain, reference["logits"]) < 0.10
    llm.engine.runner.hybrid.set_num_deferred(1)
    assert [lay.defer for lay in _blocks(llm).values()] == [1, 1, 0]  # the last defers nothing
    deferred = llm.prompt_logits(PROMPT)
    assert _rel(deferred, plain) > 1e-4  # deferral changes the result...
    assert llm.engine.runner.hybrid.pending is None  # ...and the last layer collected the deferred work
    assert len(llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]) == GREEDY["max_new_tokens"]


def test_deferral_semantics_on_gguf_blocks():
    """Two hybrid layers on GGUF blocks (mixed types): A's deferred CPU pairs leave A's output and
    reach B's; the sum is the undeferred sum (same CPU kernels, the pairs split over two tasks)."""
    from hybridmoe.config import HybridConfig
    from hybridmoe.cpu.gguf_engine import GGUFExperts
    from hybridmoe.gguf.gpu_experts import gpu_expert_weights, select_experts
    from hybridmoe.moe.hybrid import HybridExperts
    from hybridmoe.moe.options import ExpertsOptions
    from hybridmoe.moe.placement import HybridPlacement
    from hybridmoe.moe.runtime import HybridRuntime

    g = torch.Generator().manual_seed(0)
    e, h, i, k, t = 12, 256, 256, 4, 9
    mask = torch.zeros(e, dtype=torch.bool)
    mask[[1, 5, 7]] = True
    layers = []
    fulls = []
    for types in (("Q4_K", "Q5_K", "Q6_K"), ("Q8_0", "IQ4_XS", "Q4_0")):
        mats = [gq.quantize(torch.randn(e, n, kk, generator=g) / kk**0.5, ty)
                for ty, (n, kk) in zip(types, ((i, h), (i, h), (h, i)))]
        fulls.append(GGUFExperts.of(*mats, types))
    xs = [torch.randn(t, h, generator=g) for _ in range(2)]
    ids = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) for _ in range(2)]
    wts = [torch.rand(t, k, generator=g) for _ in range(2)]
    outs = {}
    for d in (0, 2):
        rt = HybridRuntime(HybridPlacement({0: mask, 3: mask}, (0, 3), d, "torch"), torch.device("cpu"), None)
        layers = [HybridExperts(gpu_expert_weights(x, mask, torch.float32), layer,
                                ExpertsOptions(hybrid=HybridConfig(method="LLAMAFILE"), runtime=rt,
                                               packed=select_experts(x, (~mask).nonzero().flatten())))
                  for x, layer in zip(fulls, (0, 3))]
        outs[d] = [lay.forward(x, i_, w) for lay, x, i_, w in zip(layers, xs, ids, wts)]
        assert rt.pending is None
    assert _rel(outs[2][0], outs[0][0]) > 1e-3  # A's output lost its deferred pairs
    assert _rel(outs[2][0] + outs[2][1], outs[0][0] + outs[0][1]) < 1e-5


# ---- layerwise prefill ----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,n_gpu", [("uniform", 0), ("uniform", 3), ("random", 3), ("front-loading", 3)])
def test_layerwise_prefill_streams_gguf_blocks(gguf, reference, file_rows, strategy, n_gpu):
    from hybridmoe.moe.layerwise import slot_bytes

    llm = LLM(gguf, kt_num_gpu_experts=n_gpu, kt_expert_placement_strategy=strategy,
              kt_gpu_prefill_token_threshold=16, **OPTS)
    rt = llm.engine.runner.hybrid
    lw = rt.layerwise
    _check_split(llm, reference, file_rows)
    assert _rel(llm.prompt_logits(PROMPT), reference["logits"]) < 1e-5  # every expert in torch
    assert lw.num_forwards == 1
    streamed = [lay for lay in _blocks(llm).values() if lay.cpu is not None]
    ec = max(lay.num_streamed for lay in streamed)
    assert lw.buffer.gate_up.shape == (ec, 2 * INTER, H)
    # one byte buffer per slot, as large as the largest layer's streamed blocks (each layer its own type)
    assert [s.numel() for s in lw.staging] == [max(slot_bytes(lay.packed_parts, lay.num_streamed)
                                                   for lay in streamed)] * 2
    plan = llm.engine.runner.moe.memory_plan
    assert lw.nbytes() <= plan.gpu["prefill buffers"] <= lw.nbytes() + 2 * 3 * 256
    # below the threshold: the CPU kernels, as without one
    short = llm.prompt_logits(SHORT)
    assert lw.num_forwards == 1
    plain = LLM(gguf, kt_num_gpu_experts=n_gpu, kt_expert_placement_strategy=strategy, **OPTS)
    assert torch.equal(short, plain.prompt_logits(SHORT))
    assert _rel(short, reference["short"]) < 0.10
    out = llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]  # layerwise prefill, CPU decode
    assert len(out) == GREEDY["max_new_tokens"] and lw.num_forwards == 2


def test_layerwise_with_deferral(gguf, reference):
    llm = LLM(gguf, kt_num_gpu_experts=3, kt_max_deferred_experts_per_token=1, kt_gpu_prefill_token_threshold=16,
              **OPTS)
    assert _rel(llm.prompt_logits(PROMPT), reference["logits"]) < 1e-5  # a layerwise forward defers nothing
    llm.generate(input_ids=PROMPT, sampling_params=GREEDY)  # decode defers
    assert llm.engine.runner.hybrid.pending is None


def test_layerwise_dynamic_update(gguf, reference, file_rows):
    """The CPU layers hold every expert (the file's whole tensors, still mapped); after the layerwise
    prefill the most-used streamed experts take GPU slots with their dequantized blocks."""
    llm = LLM(gguf, kt_num_gpu_experts=3, kt_gpu_prefill_token_threshold=16, kt_enable_dynamic_expert_update=True,
              disable_radix_cache=True, **OPTS)
    blocks = _blocks(llm)
    assert all(lay.cpu.layer.packed.num_experts == E for lay in blocks.values())
    opened = llm.engine.runner.moe.kt_weights  # the GGUF the engine mapped
    for layer, lay in blocks.items():  # views of the mapping, not copies
        assert lay.cpu.layer.packed.gate.data_ptr() == opened.tensor(f"blk.{layer}.ffn_gate_exps.weight").rows().data_ptr()
    plan = llm.engine.runner.moe.memory_plan
    per_expert = {0: 3 * H * INTER * 144 // 256, 1: 3 * H * INTER * 210 // 256, 2: 3 * H * INTER * 34 // 32}
    assert plan.host["CPU experts (GGUF blocks)"] == sum(E * b for b in per_expert.values())
    before = {k: lay.mask.clone() for k, lay in blocks.items()}
    assert _rel(llm.prompt_logits(PROMPT), reference["logits"]) < 1e-5
    lw = llm.engine.runner.hybrid.layerwise
    assert lw.total_swaps > 0 and any(not torch.equal(before[k], lay.mask) for k, lay in blocks.items())
    for lay in blocks.values():
        assert int(lay.mask.sum()) == 3
    _check_split(llm, reference, file_rows, full_cpu_layer=True)  # the swapped-in weights are the right ones
    assert _rel(llm.prompt_logits(SHORT), reference["short"]) < 0.10  # CPU kernels on the new split
    assert _rel(llm.prompt_logits(PROMPT), reference["logits"]) < 1e-5
    assert lw.last_swaps == {}  # the GPU already holds this prompt's most-used experts


def test_memory_plan_counts_the_gguf_staging(qwen3_gguf):
    """plan_memory with GGUF block sizes: the buffer in the model dtype, two staging slots of the
    layer with the largest streamed blocks, no dequantization temporaries."""
    from hybridmoe.models.registry import arch_spec
    from hybridmoe.moe.memory_plan import plan_memory
    from hybridmoe.moe.placement import place_experts
    from hybridmoe.weights.loader import load_hf_config

    cfg = load_hf_config(qwen3_gguf[0])
    spec = arch_spec(cfg)
    masks = place_experts("front-loading", list(spec.moe_layers), E, 3)  # streamed: 1, 10, 10
    per_expert = {0: 3 * H * INTER * 144 // 256, 1: 3 * H * INTER * 210 // 256, 2: 3 * H * INTER * 34 // 32}
    p = plan_memory(cfg, spec, masks, 2, "LLAMAFILE", 1024, 8, prefill_threshold=16, cpu_expert_bytes=per_expert)
    slot = 10 * per_expert[2] + 3 * 256  # layer 2 (Q8_0, 10 streamed) is the largest
    assert p.gpu["prefill buffers"] == 10 * 3 * H * INTER * 2 + 2 * slot
    assert p.host["CPU experts (GGUF blocks)"] == 1 * per_expert[0] + 10 * per_expert[1] + 10 * per_expert[2]
