"""MLA extend in its two forms (layers/attention/mla.py): the absorbed form (every new token a decode
query over its causal prefix) and the expanded one (kv_b_proj over the prefix, then SDPA) give
transformers' logits on tiny random DeepSeek-V3/V2 models through a prefill, a one-token step and an
extend over a cached prefix, and through chunked prefill plus a prefix-cache hit with greedy tokens;
and the form chosen by the cost model at DeepSeek-V3's sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_deepseek
import torch
from test_deepseek import GREEDY, _prompt, _rel

from hybridmoe import LLM
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.engine.scheduler import ScheduledBatch
from hybridmoe.layers.attention import mla
from hybridmoe.layers.attention.mla import MLAAttention, MLAConfig

from tiny_models import hf_model

variant_dir = test_deepseek.variant_dir  # the module-scoped fixture, shared (pytest finds it by this name)

FORMS = ("absorbed", "expanded")


def _force(llm: LLM, form: str) -> list[MLAAttention]:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MLAAttention)]
    assert layers
    for m in layers:
        m.extend_form = form
    return layers


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["v3", "v2_lora_greedy"])
def test_both_forms_give_the_prompt_logits_over_a_cached_prefix(name, form, variant_dir, monkeypatch):
    """A prefill of 23 tokens, one token over them, then 46 more over the 24 cached (pages of 4): every
    position's logits equal transformers' over the whole prompt, in the forced form."""
    path = variant_dir(name)
    ref = hf_model(path)
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, page_size=4)
    layers = _force(llm, form)
    calls = []
    real = MLAAttention._extend_absorbed
    monkeypatch.setattr(MLAAttention, "_extend_absorbed", lambda self, *a: (calls.append(1), real(self, *a))[1])
    runner, kv = llm.engine.runner, llm.engine.kv
    prompt = _prompt(ref.config.vocab_size, 70, 5)
    pages = kv.allocate(kv.pages_for(len(prompt)))
    req = Req(rid="x", prompt_ids=prompt, params=SamplingParams(), pages=pages)
    parts = []
    for start, n in ((0, 23), (23, 1), (24, 46)):
        req.num_computed = start
        parts.append(runner.all_logits(ScheduledBatch(reqs=[req], num_tokens=[n], sample=[True])))
    kv.release(pages, [])
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    assert _rel(torch.cat(parts), ref_logits) < 1e-4
    assert (len(calls) == 2 * len(layers)) == (form == "absorbed")  # the two non-decode steps, every layer
    llm.shutdown()


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_absorbed_form_through_chunks_prefix_hits_and_batches(name, variant_dir):
    """Greedy tokens equal transformers' with every extend absorbed: chunked prefill (chunks of 16), a
    40-token prefix-cache hit and a batch of prompts of several lengths prefilled together."""
    path = variant_dir(name)
    ref = hf_model(path)
    vocab = ref.config.vocab_size
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, chunked_prefill_size=16, page_size=4)
    _force(llm, "absorbed")

    def hf_greedy(p: list[int]) -> list[int]:
        return ref.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(p):].tolist()

    prompt = _prompt(vocab, 45, 11)
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == hf_greedy(prompt)
    second = prompt[:40] + _prompt(vocab, 9, 12)
    out = llm.generate(input_ids=second, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 40 and out["output_ids"] == hf_greedy(second)
    batch = [_prompt(vocab, n, 20 + n) for n in (3, 17, 29)]
    assert [o["output_ids"] for o in llm.generate(input_ids=batch, sampling_params=GREEDY)] == \
        [hf_greedy(p) for p in batch]
    llm.shutdown()


def _v3_layer() -> MLAAttention:
    cfg = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    with torch.device("meta"):  # shapes only
        return MLAAttention(0, 7168, 128, cfg, rotary=None, softmax_scale=0.1)


def _meta(query_lens: list[int], seq_lens: list[int], pages: int) -> SimpleNamespace:
    return SimpleNamespace(query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
                           block_table=torch.zeros(len(seq_lens), pages, dtype=torch.int32))


@pytest.mark.parametrize("query_lens,seq_lens,want", [
    ([16], [4112], "absorbed"),  # a small chunk over a long cached prefix
    ([1, 8], [30000, 9000], "absorbed"),
    ([512], [4608], "expanded"),  # a big chunk
    ([2048], [2048], "expanded"),  # a prompt without a cached prefix: the absorbing bmms alone cost kv_b's
    ([64], [64], "expanded"),
])
def test_the_cost_model_at_deepseek_v3_sizes(query_lens, seq_lens, want, monkeypatch):
    layer = _v3_layer()
    ctx = SimpleNamespace(backend=SimpleNamespace(name="triton"))
    monkeypatch.setattr(mla, "_decode_kernel", lambda ctx, like: object())  # as with the CUDA kernel
    cache = torch.empty(4096, 64, 576, device="meta")
    assert layer._extend_form(_meta(query_lens, seq_lens, 512), cache, ctx) == want
    layer.extend_form = "expanded"
    assert layer._extend_form(_meta(query_lens, seq_lens, 512), cache, ctx) == "expanded"


def test_the_torch_path_bounds_its_gather():
    """Without the kernel (mla_decode_ref gathers every block-table row per query) the absorbed form is
    taken only while that gather stays under REF_GATHER_LIMIT_BYTES."""
    layer = _v3_layer()
    ctx = SimpleNamespace(backend=SimpleNamespace(name="torch"))
    cache = torch.empty(64, 16, 576)  # on the CPU: the reference path
    assert layer._extend_form(_meta([1], [300], 19), cache, ctx) == "absorbed"
    assert layer._extend_form(_meta([16], [4112], 258), cache, ctx) == "expanded"  # 16 x 4128 x 576 x 4 B > 64 MB


def test_bench_mla_extend_smoke():
    """The benchmark's CPU smoke run: both forms agree (it asserts) and the result has every case."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_mla_extend

    out = bench_mla_extend.main(["--device", "cpu", "--grid", "0:8", "5:3", "--heads", "4", "--lkv", "32", "--rope",
                                 "8", "--nope", "16", "--v-dim", "16", "--page", "4", "--reps", "1"])
    assert [(r["prefix"], r["q"]) for r in out["rows"]] == [(0, 8), (5, 3)]
    assert all(r["rel_diff"] < 1e-4 and r["chosen"] in ("absorbed", "expanded") for r in out["rows"])
