"""Checks of the bundled demo model ``hybridmoe/demo_model/`` (built by ``scripts/train_demo_model.py``).

The model must load with plain transformers, render its ChatML template, and write English: greedy
continuations of fixed prompts have to consist mostly of words found in a reference word list (a short
list of common English words plus the words of the docstrings of a few standard-library modules), use
several distinct words, and the model must assign a fixed English sentence a much lower loss than a
random-weight model of the same shape does (about ln(4096) = 8.3 nats per token).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parent.parent / "hybridmoe" / "demo_model"
PROMPTS = ("Return the", "The default value", "This module provides")
NEW_TOKENS = 24
MIN_REAL_FRACTION = 0.6
MIN_DISTINCT_REAL_WORDS = 8  # over all prompts: a model repeating one word token does not pass
SENTENCE = "Return the number of items in the list. If the argument is omitted, the default value is used."
MAX_SENTENCE_LOSS = 5.0  # nats per token; a random-weight model scores about 8.3

# Modules whose docstrings supply the reference vocabulary, and a few common words they may lack.
WORD_SOURCE_MODULES = ("builtins", "os", "collections", "json", "re", "string", "textwrap", "argparse", "logging")
COMMON_WORDS = """
a an the and or not of to in on at by for from with without as is are was were be been being it its this that
these those which who whom what when where why how if then else than there here all any each every some no
one two three first last new old given same other such only also may must can will should would could do does
done has have had use used using return returns value values default number string list object objects file
name names type types function method module class data set get make made into out up down over under between
"""

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="demo model not built")


def _reference_words() -> set[str]:
    """Lower-case alphabetic words of COMMON_WORDS and of the docstrings of WORD_SOURCE_MODULES."""
    texts = [COMMON_WORDS]
    for name in WORD_SOURCE_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for attr in dir(module):
            obj = getattr(module, attr, None)
            texts.append(inspect.getdoc(obj) or "" if callable(obj) else "")
            if inspect.isclass(obj):
                texts.extend(inspect.getdoc(member) or "" for member in vars(obj).values() if callable(member))
    return {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}


def _words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return m.eval()


def greedy_continuations(model, tokenizer) -> dict[str, str]:
    """Greedy 24-token continuations of PROMPTS (end-of-text suppressed so each is exactly 24 tokens)."""
    out = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            assert gen.shape[1] - ids.shape[1] == NEW_TOKENS
            out[prompt] = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    return out


def english_report(continuations: dict[str, str], vocabulary: set[str]) -> tuple[bool, str]:
    """Whether every continuation is mostly reference words and enough distinct ones appear; plus details."""
    ok = True
    lines = []
    distinct: set[str] = set()
    for prompt, text in continuations.items():
        words = _words(text)
        real = [w for w in words if w in vocabulary]
        distinct.update(real)
        fraction = len(real) / len(words) if words else 0.0
        ok &= len(words) >= 4 and fraction >= MIN_REAL_FRACTION
        lines.append(f"{prompt!r} -> {text!r}: {len(real)}/{len(words)} reference words")
    ok &= len(distinct) >= MIN_DISTINCT_REAL_WORDS
    lines.append(f"{len(distinct)} distinct reference words")
    return ok, "\n".join(lines)


def sentence_loss(model, tokenizer) -> float:
    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_config_and_files():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts"] > config["num_experts_per_tok"] > 0
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert size < 10_000_000, f"demo model is {size} bytes"
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (MODEL_DIR / name).exists(), name


def test_tokenizer_and_chat_template(tokenizer, model):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert model.config.eos_token_id in (0, 2)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text).input_ids
    assert ids.count(1) == 3 and ids.count(2) == 2  # special tokens are single ids
    assert tokenizer.decode(ids) == text


def test_greedy_continuations_are_english(model, tokenizer):
    ok, report = english_report(greedy_continuations(model, tokenizer), _reference_words())
    print(report)
    assert ok, report


def test_sentence_loss_is_low(model, tokenizer):
    loss = sentence_loss(model, tokenizer)
    assert loss < MAX_SENTENCE_LOSS, f"loss {loss:.2f} nats/token on {SENTENCE!r}"
