"""A byte-level BPE tokenizer (`tokenizer.ggml.model` gpt2, the vocabulary of Qwen, DeepSeek, Llama 3
and most MoE GGUFs) built from a GGUF's metadata with the `tokenizers` library, for transformers
releases whose GGUF support lacks the conversion or the architecture (5.17 refuses deepseek2).

The pre-tokenizer split follows `tokenizer.ggml.pre` where it is known here (qwen2: the Qwen2 split;
deepseek-v3, what llama.cpp's converter writes for DeepSeek-V3/R1/V3.1: their three isolated splits);
other values get the GPT-2 byte-level split, which may tokenize some text differently from the model's
own tokenizer (`--tokenizer-path` with the Hugging Face tokenizer avoids that). Control and
user-defined tokens become added tokens; `add_bos_token` prepends BOS.
"""

from __future__ import annotations

from pathlib import Path

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
# DeepSeek-V3's tokenizer.json pre-tokenizer: three isolated regex splits in turn (digit runs of at most
# three; CJK ideographs and kana; then letters, punctuation and whitespace), each cutting the pieces the
# previous one left, then the byte-level mapping without its own regex.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
PRE_SPLITS = {"deepseek-v3": DEEPSEEK_V3_SPLITS}


def _fields(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def is_byte_level_bpe(path: Path) -> bool:
    from gguf import GGUFReader

    f = GGUFReader(str(path)).fields.get("tokenizer.ggml.model")
    return f is not None and f.contents() == "gpt2"


def build(path: Path):
    """A PreTrainedTokenizerFast of the file's gpt2-type vocabulary (ValueError when it has none)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    m = _fields(path)
    if m.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.tokens" not in m:
        raise ValueError("not a byte-level BPE (gpt2) vocabulary")
    tokens: list[str] = m["tokenizer.ggml.tokens"]
    types = m.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(x.split(" ", 1)) for x in m.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = m.get("tokenizer.ggml.pre")
    splits: tuple[str, ...] | None = PRE_SPLITS.get(pre)
    if pre in QWEN2_PRE:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        splits = (PRETOKENIZE_REGEX,)
    if splits is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def named(key: str) -> str | None:
        i = m.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos = named("bos_token_id")
    if m.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    special = {k: named(f"{k}_id") for k in ("bos_token", "eos_token", "unk_token")}
    special["pad_token"] = named("padding_token_id")
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=m.get("tokenizer.chat_template"),
                                   **{k: v for k, v in special.items() if v is not None})
