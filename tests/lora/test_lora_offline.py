"""Offline LoRA serving (LLM(..., lora_paths=...).generate(..., lora_path=...)) on a tiny random
Qwen3-MoE against peft (attention adapters made by peft) and against transformers with the LoRA
merged into its weights (hand-made PEFT-format adapter on attention, the dense layer's MLP and every
routed expert; every expert GPU side = the torch experts on this device)."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import hand_adapter, merged_hf_model, peft_adapter

from hybridmoe import LLM

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_tokens(model, prompt: list[int], n: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("qwen3_moe")
    d = tmp_path_factory.mktemp("adapters")
    a1 = peft_adapter(base, d / "a1", seed=1)
    a2 = peft_adapter(base, d / "a2", seed=2, r=8, alpha=4.0, targets=["q_proj", "v_proj"])
    return base, a1, a2


def test_peft_parity_and_base(setup):
    import peft

    from tiny_models import hf_model

    base, a1, a2 = setup
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, chunked_prefill_size=16,
              lora_paths=[f"one={a1}", str(a2)])
    vocab = llm.engine.hf_config.vocab_size
    prompt = _prompt(vocab, 23, 5)
    base_ids = _ref_tokens(hf_model(base), prompt)
    for name, path in (("one", a1), ("a2", a2)):
        ref = peft.PeftModel.from_pretrained(hf_model(base), str(path)).eval()
        want = _ref_tokens(ref, prompt)
        assert want != base_ids, "the adapter must change the output for the test to mean anything"
        got = llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)["output_ids"]
        assert got == want, name
    assert llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == base_ids
    # mixed in one batch: each prompt gets its own adapter's tokens
    outs = llm.generate(input_ids=[prompt, prompt, prompt], sampling_params=GREEDY, lora_path=["one", None, "a2"])
    assert outs[1]["output_ids"] == base_ids
    assert outs[0]["output_ids"] == llm.generate(input_ids=prompt, sampling_params=GREEDY,
                                                 lora_path="one")["output_ids"]
    llm.shutdown()


def test_expert_lora_parity(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    base = tiny_model_dir("qwen3_moe")
    cfg = AutoConfig.from_pretrained(str(base))
    ad = hand_adapter(cfg, tmp_path / "ex", seed=3)
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, chunked_prefill_size=16, lora_paths=[str(ad)])
    prompt = _prompt(cfg.vocab_size, 19, 7)
    ref = merged_hf_model(base, ad)
    want = _ref_tokens(ref, prompt)
    assert want != llm.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"], "the adapter changes nothing"
    got = llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="ex")["output_ids"]
    assert got == want
    llm.shutdown()


def test_errors(setup, tmp_path):
    from hybridmoe.engine.engine import RequestError
    from hybridmoe.lora.adapter import LoRAAdapterError

    base, a1, a2 = setup
    with pytest.raises(LoRAAdapterError, match="exceeds --max-lora-rank 4"):
        LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[str(a2)], max_lora_rank=4)
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[str(a1)])
    with pytest.raises(RequestError, match="unknown LoRA adapter 'nope'"):
        llm.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="nope")
    llm.shutdown()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.zz_proj.lora_A.weight": torch.zeros(4, 72),
               "base_model.model.model.layers.0.self_attn.zz_proj.lora_B.weight": torch.zeros(72, 4)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"adapter_model.safetensors: .*zz_proj.*unknown target module"):
        LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[str(bad)])
