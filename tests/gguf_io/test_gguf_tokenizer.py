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


def _tokenizer_only_gguf(path, arch: str, pre: str = "default", add_bos: bool = False):
    """A GGUF holding only the demo model's vocabulary (gguf_files.add_tokenizer) under `arch`."""
    from gguf import GGUFWriter
    from gguf_files import add_tokenizer

    w = GGUFWriter(str(path), arch)
    add_tokenizer(w)
    if pre != "default" or add_bos:  # rewrite the two fields add_tokenizer set
        w.kv_data[0].pop("tokenizer.ggml.pre", None)
        w.kv_data[0].pop("tokenizer.ggml.add_bos_token", None)
        w.add_tokenizer_pre(pre)
        w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
        w.add_bos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_own_mapping_for_an_architecture_transformers_refuses(tmp_path, monkeypatch):
    """deepseek2 (which transformers 5.17's GGUF loading refuses) through gguf/bpe_tokenizer.py."""
    gguf = _tokenizer_only_gguf(tmp_path / "ds.gguf", "deepseek2")
    _hide_internal_conversion(monkeypatch)
    save_tokenizer(gguf, tmp_path / "out")
    got, demo = AutoTokenizer.from_pretrained(tmp_path / "out"), AutoTokenizer.from_pretrained("hybridmoe/demo_model")
    for text in TEXTS:
        assert got(text).input_ids == demo(text).input_ids, text
    msgs = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        demo.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert got.decode(got("  two spaces\nand 1234").input_ids) == "  two spaces\nand 1234"


def test_own_mapping_follows_the_pre_tokenizer_and_bos(tmp_path, monkeypatch):
    gguf = _tokenizer_only_gguf(tmp_path / "q.gguf", "qwen3moe", pre="qwen2", add_bos=True)
    _hide_internal_conversion(monkeypatch)
    save_tokenizer(gguf, tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("and 1234").input_ids
    assert ids[0] == 0  # BOS prepended
    assert tok.convert_ids_to_tokens(ids[-4:]) == ["1", "2", "3", "4"]  # the Qwen2 split: one digit each


def test_other_vocabularies_go_through_auto_tokenizer(qwen3_gguf, tmp_path, monkeypatch):
    _, gguf, _ = qwen3_gguf
    _hide_internal_conversion(monkeypatch)
    monkeypatch.setattr("hybridmoe.gguf.bpe_tokenizer.is_byte_level_bpe", lambda path: False)
    save_tokenizer(gguf, tmp_path / "auto")
    tok = AutoTokenizer.from_pretrained(tmp_path / "auto")
    assert tok("Hello world").input_ids == AutoTokenizer.from_pretrained("hybridmoe/demo_model")("Hello world").input_ids


# DeepSeek-V3's pre_tokenizer as its published tokenizer.json states it (the reference: tokenizers builds it
# from this JSON; ours is built from `tokenizer.ggml.pre` = "deepseek-v3", what llama.cpp's converter writes).
DSV3_PRE_TOKENIZER = r'''{"type": "Sequence", "pretokenizers": [
 {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
 {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
 {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
 {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}'''
DSV3_TEXTS = ("Price 1234567 yuan", "价格是1234元，好的。", "カタカナとひらがなと漢字", ".NET and C# x=1+2;", "a\r\n\r\nb",
              "  multiple   spaces  \n\n", "émigré naïve café", "😀 emoji!!! ???", "\t tab\ttab", "ab12cd345ef6789")


def _dsv3_reference(vocab_tokenizer):
    """The demo vocabulary and merges under DeepSeek-V3's published pre-tokenizer."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(vocab_tokenizer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = json.loads(DSV3_PRE_TOKENIZER)
    spec["normalizer"] = None
    return Tokenizer.from_str(json.dumps(spec))


def test_own_mapping_splits_as_deepseek_v3_does(tmp_path, monkeypatch):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    gguf = _tokenizer_only_gguf(tmp_path / "ds.gguf", "deepseek2", pre="deepseek-v3")
    _hide_internal_conversion(monkeypatch)
    save_tokenizer(gguf, tmp_path / "out")
    ours = AutoTokenizer.from_pretrained(tmp_path / "out")
    ref = _dsv3_reference(AutoTokenizer.from_pretrained("hybridmoe/demo_model"))
    mine = ours.backend_tokenizer.pre_tokenizer

    def same(text: str) -> None:
        assert mine.pre_tokenize_str(text) == ref.pre_tokenizer.pre_tokenize_str(text), text
        assert ours(text, add_special_tokens=False).input_ids == ref.encode(text, add_special_tokens=False).ids, text

    for text in DSV3_TEXTS:
        same(text)
    assert [p for p, _ in mine.pre_tokenize_str("1234567")] == ["123", "456", "7"]  # not the GPT-2 split
    alphabet = st.sampled_from(list("aZé 12\n\r\t.,!?#-_中文かナ😀") + ["  ", "\r\n"])
    settings(max_examples=150, deadline=None)(given(st.lists(alphabet, max_size=24).map("".join))(same))()
