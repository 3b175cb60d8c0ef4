"""A request's leftovers in the KV pages it freed never reach the next request using those pages.

Freed pages are not cleared, and a page a sequence has only partly filled (and the block-table
padding) is read by the batched decode paths and masked. Masking by a probability of 0 is not enough:
0 * NaN is NaN, so a request whose keys or values overflowed (or one served with a non-finite LoRA
adapter) turned every later request's decode into NaN logits (greedy token 0 forever) in the torch
attention backend and the torch MLA decode, the CPU paths of those models. Here every page is filled
with NaN between two runs of the same prompt: the tokens must not change.
"""

from __future__ import annotations

import pytest

from hybridmoe import LLM

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = [9, 6, 7, 21, 30]  # 5 tokens: the decode steps end mid-page (page size 16)


@pytest.mark.parametrize(("kind", "kw"), [
    ("qwen3_moe", {"dtype": "float32"}),  # torch attention backend
    ("mixtral", {"dtype": "float32"}),
    ("deepseek_v3", {"dtype": "float32"}),  # MLA: the absorbed torch decode
    ("qwen3_moe", {"dtype": "bfloat16", "kt_method": "BF16", "kt_num_gpu_experts": 0}),  # native CPU attention
], ids=["torch-gqa", "torch-mixtral", "torch-mla", "native-cpu"])
def test_nan_leftovers_in_freed_pages_change_nothing(tiny_model_dir, kind, kw):
    llm = LLM(str(tiny_model_dir(kind)), device="cpu", progress=False, **kw)
    ref = llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    assert llm.engine.flush_cache()  # the prompt's pages are free again, not a prefix-cache hit
    for layer in llm.engine.runner.kv_caches:
        for t in layer:
            t.fill_(float("nan"))
    assert llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == ref
