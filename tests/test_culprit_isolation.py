"""A request whose own values blow up (its hidden state non-finite: an overflow, a hostile adapter) fails
alone; the requests batched with it compute the step again and get the tokens they get alone.

The CPU experts refuse a non-finite routing weight and name the token (CPUMoEError.token); the engine
maps it to its request (Engine._fail_culprit). Before, the whole batch ended with "engine failure".
Here one token's embedding row is NaN, so exactly the request whose prompt holds it goes non-finite.
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
POISON = 77  # the token whose embedding is NaN
A, C = [5, 6, 7, 8], [9, 10, 11]


@pytest.mark.parametrize("kw", [
    {"dtype": "float32", "kt_method": "BF16", "kt_num_gpu_experts": 0},
    {"dtype": "bfloat16", "kt_method": "BF16", "kt_num_gpu_experts": 0},  # CPU-only: native layer decode
    {"dtype": "float32", "kt_method": "BF16", "kt_num_gpu_experts": 3},  # experts on both sides
    # deferred CPU experts: two failed tasks in the step (the deferred one's error reported with it)
    {"dtype": "bfloat16", "kt_method": "AMXINT8", "kt_num_gpu_experts": 2, "kt_max_deferred_experts_per_token": 2},
    # int8 attention projections: the dense linear refuses the row first ("row N of the input holds NaN")
    {"dtype": "bfloat16", "kt_method": "AMXINT8", "kt_num_gpu_experts": 0, "cpu_dense_weights": "int8"},
], ids=["fp32-cpu-experts", "bf16-cpu-only", "fp32-hybrid", "int8-deferred", "int8-dense"])
@pytest.mark.parametrize("where", ["prompt", "decode"])
def test_the_request_at_fault_fails_alone(tiny_model_dir, kw, where):
    llm = LLM(str(tiny_model_dir("qwen3_moe")), device="cpu", progress=False, **kw)
    alone = [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in (A, C)]
    bad = [3, POISON, 4] if where == "prompt" else [3, 4]
    if where == "decode":  # the poisoned token is the one it samples first: it fails at its first decode step
        POISONED = llm.generate(input_ids=bad, sampling_params=dict(GREEDY, max_new_tokens=1))["output_ids"][0]
    else:
        POISONED = POISON
    with torch.no_grad():
        llm.engine.runner.model.model.embed_tokens.weight[POISONED] = float("nan")
    if where == "decode" and POISONED in [t for p in (A, C) for t in p + alone[(A, C).index(p)]]:
        pytest.skip(f"token {POISONED} is in the other requests' prompts or outputs too")
    outs = llm.generate(input_ids=[A, bad, C], sampling_params=GREEDY)
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert reasons[1]["type"] == "abort" and reasons[1]["status_code"] == 500, reasons
    assert "non-finite routing weight" in reasons[1]["message"] or "holds NaN or Inf" in reasons[1]["message"]
    if kw.get("cpu_dense_weights") != "int8":  # int8 copies serve <= 4 rows only: alone != batched by design
        assert [outs[0]["output_ids"], outs[2]["output_ids"]] == alone
    assert reasons[0]["type"] == reasons[2]["type"] == "length"
    assert llm.engine.stats()["kv_used_pages"] == 0 and llm.engine.failed_requests == 1


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_logits_fail_their_request_alone(tiny_model_dir, monkeypatch, overlap, dtype):
    """A request whose logits are NaN (its values blew up after the last check of the CPU experts: the
    final norm, the LM head) ends with a clear error, and the others of the batch keep their tokens. Before,
    greedy decoding took token 0 from NaN logits, step after step, and returned it as text. With overlap
    scheduling the sampled ids are read a step later: the sampler marks the row (no host sync), and the
    request, computed once more meanwhile, fails when its mark is read."""
    flag = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    llm = LLM(str(tiny_model_dir("qwen3_moe")), device="cpu", progress=False, dtype=dtype, **flag)
    assert llm.engine.pipeline.overlap is overlap
    alone = [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in (A, C)]
    runner = llm.engine.runner
    real = runner.model.compute_logits
    poisoned = {"rows": 0}

    def compute_logits(hidden):  # [B, H] -> [B, V]: the second row of a 3-row step NaN, once
        out = real(hidden)
        if out.shape[0] == 3 and not poisoned["rows"]:
            out = out.clone()
            out[1] = float("nan")
            poisoned["rows"] = 1
        return out

    monkeypatch.setattr(runner.model, "compute_logits", compute_logits)
    outs = llm.generate(input_ids=[A, [3, 4], C], sampling_params=GREEDY)
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert poisoned["rows"] == 1
    assert reasons[1]["type"] == "abort" and "logits for this request are NaN" in reasons[1]["message"], reasons
    assert reasons[1]["status_code"] == 500
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == alone
    assert reasons[0]["type"] == reasons[2]["type"] == "length"
    assert llm.engine.stats()["kv_used_pages"] == 0 and llm.engine.failed_requests == 1
