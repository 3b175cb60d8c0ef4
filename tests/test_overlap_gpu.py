"""Overlap scheduling on CUDA with decode graphs (GPU only): the tokens with it on equal those with it
off, the decode graphs' input ids resolved from the device ring, all-GPU and hybrid (CPU experts
driven from the stream, their tasks queued ahead of a step still running)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM

from tiny_models import hf_model, make_tiny_model

pytestmark = pytest.mark.gpu


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(n, s) for n, s in ((1, 1), (9, 2), (30, 3), (61, 4), (17, 5), (40, 6), (5, 7), (25, 8))]
GREEDY = {"temperature": 0, "ignore_eos": True}
PARAMS = [
    dict(GREEDY, max_new_tokens=24),
    dict(GREEDY, max_new_tokens=1),
    dict(GREEDY, max_new_tokens=0),
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "max_new_tokens": 20, "sampling_seed": 3, "ignore_eos": True},
    dict(GREEDY, max_new_tokens=16, repetition_penalty=1.2),  # a synchronous step next to overlapped ones
    dict(GREEDY, max_new_tokens=30, min_new_tokens=5, logit_bias={"9": 1.5}),
    {"temperature": 0.7, "max_new_tokens": 12, "n": 2, "sampling_seed": 9, "ignore_eos": True},
    dict(GREEDY, max_new_tokens=28),
]


def _run(llm: LLM, stop_ids: list[int]) -> tuple[list[tuple], list[list[int]]]:
    """(mixed batch: (tokens, finish reason) per output; a batch decoding together to its length).

    The second batch has the same composition at every step with overlap on and off (admitted
    together, no early ends), so even bf16 must give the same tokens; the mixed one's batches differ
    (a request that stopped is computed once more, admissions come a step later), which in bf16 can
    flip a near-tie through the GEMMs' batch-size-dependent rounding: compared exactly in float32."""
    params = [dict(p, stop_token_ids=stop_ids) if i == 7 else p for i, p in enumerate(PARAMS)]
    outs = llm.generate(input_ids=PROMPTS, sampling_params=params)
    decode = llm.generate(input_ids=[p[:12] for p in PROMPTS[2:7]], sampling_params=dict(GREEDY, max_new_tokens=40))
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs], [o["output_ids"] for o in decode]


def _resolves(llm: LLM) -> list[int]:
    """Counts the decode graphs' placeholder resolutions (the graphs share the runner's ring)."""
    future = llm.engine.runner.future
    calls = [0]
    real = future.resolve_

    def counted(ids, host):
        calls[0] += 1
        real(ids, host)

    future.resolve_ = counted
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlap_equal_with_cuda_graphs(tiny_model_dir, dtype):
    path = str(tiny_model_dir("qwen3_moe"))
    opts = dict(device="cuda", dtype=dtype, progress=False, chunked_prefill_size=24, page_size=8,
                max_total_tokens=4096, cuda_graph_max_bs=8)
    results = []
    stop_ids: list[int] = []
    for overlap in (False, True):
        llm = LLM(path, disable_overlap_schedule=not overlap, **opts)
        assert llm.engine.overlap is overlap and llm.engine.runner.graphs is not None
        if not stop_ids:
            ref = llm.generate(input_ids=PROMPTS[7], sampling_params=dict(GREEDY, max_new_tokens=28))["output_ids"]
            stop_ids = [ref[10]]
        calls = _resolves(llm)
        results.append(_run(llm, stop_ids))
        assert llm.engine.kv.num_used() == 0 and not llm.engine.has_work()
        if overlap:
            assert llm.engine.pipeline.overlapped_steps > 0 and calls[0] > 0  # graphs replayed with placeholders
        else:
            assert calls[0] == 0
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    (mixed_off, decode_off), (mixed_on, decode_on) = results
    assert decode_on == decode_off
    if dtype == "float32":
        assert mixed_on == mixed_off
        assert mixed_off[8][1]["type"] == "stop"  # the 8th prompt (after the n=2 pair)


def test_overlap_is_the_cuda_default(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3_moe")), device="cuda", progress=False, max_total_tokens=2048,
              cuda_graph_max_bs=2)
    assert llm.engine.overlap


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("ovl")
    hf_model(make_tiny_model("qwen3_moe", d / "f32")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    return str(d / "bf16")


@pytest.mark.parametrize("deferred", [0, 1])
def test_overlap_equal_hybrid_stream_path(bf16_model, deferred):
    """CPU experts driven from the CUDA stream (gated tasks queued before each replay, possibly while
    the step before still runs): overlap on equals off."""
    opts = dict(device="cuda", dtype="bfloat16", progress=False, kt_method="BF16", kt_num_gpu_experts=4,
                kt_max_deferred_experts_per_token=deferred, max_total_tokens=4096, cuda_graph_max_bs=8,
                chunked_prefill_size=24, page_size=8)
    results = []
    for overlap in (False, True):
        llm = LLM(bf16_model, disable_overlap_schedule=not overlap, **opts)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.before_replay
        results.append(_run(llm, [5]))
        if overlap:
            assert llm.engine.pipeline.overlapped_steps > 0
        assert llm.engine.kv.num_used() == 0
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    (mixed_off, decode_off), (mixed_on, decode_on) = results
    assert decode_on == decode_off  # bf16: the mixed batch is not compared token for token (see _run)
    assert all(r["type"] in ("stop", "length") for _, r in mixed_on)
