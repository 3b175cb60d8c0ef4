"""NaN logits on CUDA (GPU only): a request whose values blow up on the GPU fails alone with a clear error,
with overlap scheduling on and off and with decode graphs on and off, and the others of its batch keep the
tokens they get alone. Before, greedy decoding took the argmax of NaN (token 0 or the first NaN) step after
step and returned it as text: the GPU has no CPU expert check, and a host-side check would cost a sync.

With CPU experts (hybrid), their tasks run from the CUDA stream and report errors only after the step, so a
task that failed on one token's NaN failed the whole batch and the next; they now write NaN for that token
(HmTask.nan_rows) and the sampler fails its request alone.

One token's embedding row is NaN, so exactly the request whose prompt (or first sampled token) holds it goes
non-finite: everything computes per token or per sequence, so the NaN stays in that request."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
POISON = 77
A, C = [5, 6, 7, 8], [9, 10, 11]


SETUPS = {"gpu": {}, "hybrid": {"kt_method": "BF16", "kt_num_gpu_experts": 3},
          "int8-deferred": {"kt_method": "AMXINT8", "kt_num_gpu_experts": 2, "kt_max_deferred_experts_per_token": 2}}


# (setup, CUDA graphs, overlap scheduling): every setup with both on and both off, all-GPU with graphs alone too
CASES = [(s, g, o) for s in SETUPS for g, o in ((True, True), (False, False))] + [("gpu", True, False)]


@pytest.mark.parametrize("setup,graphs,overlap", CASES, ids=[f"{s}-{'graphs' if g else 'eager'}-{'overlap' if o else 'sync'}"
                                                              for s, g, o in CASES])
@pytest.mark.parametrize("where", ["prompt", "decode"])
def test_nan_on_the_gpu_fails_its_request_alone(tiny_model_dir, setup, graphs, overlap, where):
    llm = LLM(str(tiny_model_dir("qwen3_moe")), device="cuda", dtype="float32", progress=False,
              max_total_tokens=2048, cuda_graph_max_bs=4, disable_cuda_graph=not graphs,
              disable_overlap_schedule=not overlap, **SETUPS[setup])
    assert llm.engine.overlap is overlap and (llm.engine.runner.graphs is not None) is graphs
    alone = [llm.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in (A, C)]
    bad = [3, POISON, 4] if where == "prompt" else [3, 4]
    poisoned = POISON if where == "prompt" else \
        llm.generate(input_ids=bad, sampling_params=dict(GREEDY, max_new_tokens=1))["output_ids"][0]
    if poisoned in [t for p, out in zip((A, C), alone) for t in p + out]:
        pytest.skip(f"token {poisoned} is in the other requests' prompts or outputs too")
    with torch.no_grad():
        llm.engine.runner.model.model.embed_tokens.weight[poisoned] = float("nan")
    outs = llm.generate(input_ids=[A, bad, C], sampling_params=GREEDY)
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    assert reasons[1]["type"] == "abort" and "logits for this request are NaN" in reasons[1]["message"], reasons
    assert reasons[1]["status_code"] == 500
    assert [outs[0]["output_ids"], outs[2]["output_ids"]] == alone
    assert reasons[0]["type"] == reasons[2]["type"] == "length"
    assert llm.engine.kv.num_used() == 0 and llm.engine.failed_requests == 1 and llm.engine.failed_batches == 0
    # the engine goes on: the poisoned request's pages (NaN KV) reused by the next ones do not leak into them
    with torch.no_grad():
        llm.engine.runner.model.model.embed_tokens.weight[poisoned] = 0.0
    assert [o["output_ids"] for o in llm.generate(input_ids=[A, C], sampling_params=GREEDY)] == alone
    llm.shutdown()
