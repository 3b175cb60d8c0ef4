"""The GGUF tokenizer when transformers lacks the conversion functions hybridmoe uses first (as in
transformers 5.17): the public AutoTokenizer GGUF loading gives the same tokenizer and chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hybridmoe.gguf.tokenizer import save_tokenizer

TEXTS = ("Hello world, how are you?", "  two spaces\nand a newline 1234", "<|im_start|>user\nhi<|im_end|>")


def _hide_internal_conversion(monkeypatch):
    monkeypatch.setattr("hybridmoe.gguf.tokenizer._internal_conversion", lambda: None)


def test_fallback_through_auto_tokenizer_gives_the_same_tokenizer(qwen3_gguf, tmp_path, monkeypatch):
    _, gguf, _ = qwen3_gguf
    save_tokenizer(gguf, tmp_path / "first")
    _hide_internal_conversion(monkeypatch)
    save_tokenizer(gguf, tmp_path / "fallback")
    monkeypatch.undo()
    a, b = AutoTokenizer.from_pretrained(tmp_path / "first"), AutoTokenizer.from_pretrained(tmp_path / "fallback")
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids, text
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert a.eos_token == b.eos_token == "<|im_end|>"


def test_a_tokenizer_neither_path_converts_is_one_error_naming_the_file(tmp_path, monkeypatch):
    from hybridmoe.gguf.tokenizer import GGUFTokenizerError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    _hide_internal_conversion(monkeypatch)
    with pytest.raises(GGUFTokenizerError, match="bad.gguf.*--tokenizer-path"):
        save_tokenizer(bad, tmp_path / "out")
