"""Several adapters in one batch (3 adapters + the base, mixed, chunked prefill) each give the tokens
they get alone; at most --max-loras-per-batch adapters run together; the prefix cache is keyed by
adapter; the batched LoRA op against its reference (odd sizes, T=0, T=1, no-adapter tokens)."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import hand_adapter, peft_adapter

from hybridmoe import LLM
from hybridmoe.lora.ops import lora_delta_ref, lora_delta_torch

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("t,s,r,k,n", [(0, 3, 4, 7, 5), (1, 1, 2, 9, 3), (37, 4, 5, 33, 19), (5, 8, 16, 64, 130)])
def test_lora_delta_torch_matches_reference(t, s, r, k, n):
    g = torch.Generator().manual_seed(t + s)
    x, a, bt = torch.randn(t, k, generator=g), torch.randn(s, r, k, generator=g), torch.randn(s, r, n, generator=g)
    scale = torch.rand(s, generator=g) + 0.5
    idx = torch.randint(-1, s, (t,), generator=g, dtype=torch.int32)
    got = lora_delta_torch(x, a, bt, scale, idx)
    ref = lora_delta_ref(x, a, bt, scale, idx)
    assert got.shape == (t, n)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert (got[idx < 0] == 0).all()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    base = tiny_model_dir("qwen3_moe")
    cfg = AutoConfig.from_pretrained(str(base))
    d = tmp_path_factory.mktemp("batch_adapters")
    return base, [f"p1={peft_adapter(base, d / 'p1', seed=11)}", f"p2={peft_adapter(base, d / 'p2', seed=12, r=8)}",
                  f"ex={hand_adapter(cfg, d / 'ex', seed=13)}"]


def test_mixed_batch_chunked_prefill_and_adapter_limit(adapters):
    base, paths = adapters
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, chunked_prefill_size=12, lora_paths=paths,
              max_loras_per_batch=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (17, 9, 26, 13, 20, 5)]
    loras = ["p1", None, "ex", "p2", "p1", "ex"]
    alone = [llm.generate(input_ids=p, sampling_params=GREEDY, lora_path=lo)["output_ids"] for p, lo in zip(prompts, loras)]
    assert len({tuple(a) for a in alone[:4]}) == 4  # four different models
    seen: list[set] = []
    sched = llm.engine.scheduler
    orig = sched.schedule

    def spy():
        batch = orig()
        if batch is not None:
            seen.append({r.lora_name for r, n in zip(batch.reqs, batch.num_tokens) if n > 0} - {None})
        return batch

    sched.schedule = spy
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)
    assert [o["output_ids"] for o in outs] == alone
    assert seen and max(len(s) for s in seen) <= 2  # --max-loras-per-batch 2 distinct adapters per batch
    assert any(len(s) == 2 for s in seen)
    llm.shutdown()


def test_prefix_cache_not_shared_across_adapters(adapters):
    base, paths = adapters
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, page_size=4, lora_paths=paths[:2])
    p = torch.randint(0, 211, (33,), generator=torch.Generator().manual_seed(4)).tolist()
    cached = {}
    outs = {}
    for lora in ("p1", "p1", "p2", None, "p2"):
        o = llm.generate(input_ids=p, sampling_params=GREEDY, lora_path=lora)
        cached.setdefault(lora, []).append(o["meta_info"]["cached_tokens"])
        outs.setdefault(lora, []).append(o["output_ids"])
    assert cached["p1"][0] == 0 and cached["p1"][1] > 0  # reused under the same adapter
    assert cached["p2"][0] == 0 and cached["p2"][1] > 0  # never the other adapter's prefix
    assert cached[None] == [0]
    assert all(len(set(map(tuple, v))) == 1 for v in outs.values())
    llm.shutdown()


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_prepare_graph_fills_the_index_buffer(cuda, monkeypatch):
    """A graph replay's per-row slots (padding rows -1) reach batch.graph_index from the manager's own host
    buffer; each replay's rows overwrite the last one's (on CUDA the copy is asynchronous, behind an event)."""
    from types import SimpleNamespace

    from torch import nn

    from hybridmoe.lora.manager import LoRAManager

    if cuda and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    mgr = LoRAManager(nn.Module(), torch.device("cuda" if cuda else "cpu"), torch.float32, 3, 4, [], graph_capacity=8)
    monkeypatch.setattr(mgr, "slots_for", lambda keys: [{None: -1, "a": 0, "b": 2}[k] for k in keys])
    for keys, bs in ((["a", None, "b"], 4), (["b"], 2), (["a"] * 8, 8), ([None, "b"], 2)):
        mgr.prepare_graph([SimpleNamespace(lora_key=k) for k in keys], bs)
        want = [{None: -1, "a": 0, "b": 2}[k] for k in keys] + [-1] * (bs - len(keys))
        assert mgr.batch.index(bs).tolist() == want
        assert mgr.batch.current.data_ptr() == mgr.batch.graph_index.data_ptr()  # the graph's own buffer
