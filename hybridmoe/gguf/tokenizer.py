"""The tokenizer a GGUF file carries (`tokenizer.ggml.*` and `tokenizer.chat_template`), saved as
Hugging Face tokenizer files, through transformers' GGUF tokenizer conversion
(transformers.integrations.gguf: byte-level BPE `gpt2` and sentencepiece `llama` vocabularies, the
pre-tokenizer split of `tokenizer.ggml.pre`, control tokens as special tokens). Those functions moved
between transformers releases (5.17 has neither), so where they are missing a byte-level BPE
vocabulary is built by our own mapping (gguf/bpe_tokenizer.py) and any other through the public
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
"""

from __future__ import annotations

from pathlib import Path


class GGUFTokenizerError(ValueError):
    """A GGUF whose tokenizer metadata cannot be turned into a tokenizer."""


def _refused(gguf_file: str | Path, what: str, e: BaseException) -> GGUFTokenizerError:
    """The error for `e` from transformers or tokenizers, on one line (theirs may span several); a
    KeyError is a metadata key the conversion looked for (its text alone would be the bare name)."""
    text = f"no tokenizer.ggml.{e.args[0]} in the metadata" if isinstance(e, KeyError) and e.args else str(e)
    return GGUFTokenizerError(f"{gguf_file}: {what} ({' '.join(text.split())}); pass --tokenizer-path with a "
                              "Hugging Face tokenizer")


def _internal_conversion():
    """transformers' (convert_gguf_tokenizer, get_gguf_tokenizer), or None in a release without them."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        return None
    return convert_gguf_tokenizer, get_gguf_tokenizer


def save_tokenizer(gguf_file: str | Path, out_dir: str | Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template included) of `gguf_file` into out_dir."""
    from transformers import PreTrainedTokenizerFast

    found = _internal_conversion()
    if found is None:  # another transformers layout: our own BPE mapping, or its public GGUF loading
        _save_without_the_conversion(Path(gguf_file), out_dir)
        return
    convert_gguf_tokenizer, get_gguf_tokenizer = found
    try:
        arch, tok_dict, tok_config = get_gguf_tokenizer(str(gguf_file))
        if "tokens" not in tok_dict:
            raise ValueError("no tokenizer.ggml.tokens")
        if tok_dict.get("tokenizer_type") == "gpt2" and "merges" not in tok_dict:
            raise ValueError("a byte-level BPE (gpt2) vocabulary without tokenizer.ggml.merges")
        backend, extra = convert_gguf_tokenizer(arch, tok_dict)
        kwargs = {k: v for k, v in {**tok_config, **extra}.items() if v is not None}
        # inside the try: the metadata's values reach the tokenizer's own checks here (add_bos_token)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    except Exception as e:  # noqa: BLE001  (transformers raises several types; name the file)
        raise _refused(gguf_file, "its tokenizer metadata cannot be converted", e) from None
    tok.save_pretrained(str(out_dir))


def _split_like_the_vocabulary(tok, gguf_file: Path) -> None:
    """A Qwen2-family vocabulary (`tokenizer.ggml.pre` qwen2) splits digits one by one and keeps
    newlines apart; transformers' generic GGUF loading may leave the GPT-2 split, which tokenizes such
    text differently from the model's own tokenizer. Other `pre` values keep what transformers built."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_file)).fields.get("tokenizer.ggml.pre")
    pre = field.contents() if field is not None else None
    if pre not in ("qwen2", "deepseek-r1-qwen"):
        return
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _save_without_the_conversion(gguf_file: Path, out_dir: str | Path) -> None:
    from hybridmoe.gguf import bpe_tokenizer

    try:
        byte_level = bpe_tokenizer.is_byte_level_bpe(gguf_file)
    except Exception as e:  # noqa: BLE001  (not a readable GGUF)
        raise _refused(gguf_file, "its tokenizer metadata cannot be read", e) from None
    if not byte_level:
        _save_through_auto_tokenizer(gguf_file, out_dir)
        return
    try:
        tok = bpe_tokenizer.build(gguf_file)
    except Exception as e:  # noqa: BLE001  (malformed vocabulary or merges: name the file)
        raise _refused(gguf_file, "its tokenizer metadata cannot be converted", e) from None
    tok.save_pretrained(str(out_dir))


def _save_through_auto_tokenizer(gguf_file: Path, out_dir: str | Path) -> None:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:  # noqa: BLE001  (ImportError of an old transformers, parse errors, ...)
        raise _refused(gguf_file, "this transformers cannot convert its tokenizer", e) from None
    _split_like_the_vocabulary(tok, gguf_file)
    # Saved as a plain fast tokenizer: a model class (Qwen2Tokenizer) would impose its own split on reload.
    from transformers import PreTrainedTokenizerFast

    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    plain = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, chat_template=tok.chat_template,
                                    **{k: v for k, v in special.items() if v is not None})
    plain.save_pretrained(str(out_dir))
