"""Text in and out with the bundled demo model: tokenizer, chat template, stop strings,
incremental detokenization."""

from __future__ import annotations

import pytest
import torch
import transformers

from hybridmoe import LLM
from hybridmoe.config import DEMO_MODEL_PATH
from hybridmoe.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", progress=False)  # the demo model is the default


def test_demo_model_is_default_and_matches_transformers(llm):
    assert llm.args.model_path == DEMO_MODEL_PATH
    ref = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode("The default value of the argument")
    out = llm.generate(prompt="The default value of the argument",
                       sampling_params={"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
    ref_ids = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None, repetition_penalty=1.0,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert out["output_ids"] == ref_ids
    assert out["text"] == llm.tokenizer.decode(ref_ids, skip_special_tokens=True)


def test_stop_string_trims_text(llm):
    base = llm.generate(prompt="Return the", sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                              "ignore_eos": True})
    text = base["text"]
    word = text.split()[2]  # a word from the middle of the greedy continuation
    cut = text.index(word)
    out = llm.generate(prompt="Return the", sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                             "ignore_eos": True, "stop": [word, "zzzz"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert out["text"] == text[:cut]
    kept = llm.generate(prompt="Return the", sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                              "ignore_eos": True, "stop": word, "no_stop_trim": True})
    assert kept["text"] == text[:cut + len(word)]


def test_chat_template_and_eos(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What does os.getcwd do?"}],
                                               tokenize=False, add_generation_prompt=True)
    out = llm.generate(prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 60})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "<|im_end|>" not in out["text"] and len(out["text"].split()) >= 3


def test_incremental_detokenizer_never_splits_characters():
    tok = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    text = "naïve café — 数据 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
