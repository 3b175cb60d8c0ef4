"""The tokenizer a GGUF file carries (`tokenizer.ggml.*` and `tokenizer.chat_template`), saved as
Hugging Face tokenizer files, through transformers' GGUF tokenizer conversion
(transformers.integrations.gguf: byte-level BPE `gpt2` and sentencepiece `llama` vocabularies, the
pre-tokenizer split of `tokenizer.ggml.pre`, control tokens as special tokens).
"""

from __future__ import annotations

from pathlib import Path


class GGUFTokenizerError(ValueError):
    """A GGUF whose tokenizer metadata cannot be turned into a tokenizer."""


def save_tokenizer(gguf_file: str | Path, out_dir: str | Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template included) of `gguf_file` into out_dir."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as e:  # an older transformers: name what is missing
        raise GGUFTokenizerError(f"{gguf_file}: this transformers has no GGUF tokenizer conversion ({e}); "
                                 "pass --tokenizer-path with a Hugging Face tokenizer") from None
    try:
        arch, tok_dict, tok_config = get_gguf_tokenizer(str(gguf_file))
        if "tokens" not in tok_dict:
            raise ValueError("no tokenizer.ggml.tokens")
        backend, extra = convert_gguf_tokenizer(arch, tok_dict)
    except Exception as e:  # noqa: BLE001  (transformers raises several types; name the file)
        raise GGUFTokenizerError(f"{gguf_file}: its tokenizer metadata cannot be converted ({e}); pass "
                                 "--tokenizer-path with a Hugging Face tokenizer") from None
    kwargs = {k: v for k, v in {**tok_config, **extra}.items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tok.save_pretrained(str(out_dir))
