"""The tokenizer and the end-of-sequence ids of a model directory."""

from __future__ import annotations

import logging
from pathlib import Path

from hybridmoe.config import EngineArgs

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one: the tokenizer loads


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether the engine loads a tokenizer from directory `path` (without one: token ids in and out only)."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def _load_tokenizer(args: EngineArgs):
    if args.skip_tokenizer_init:
        return None
    path = args.tokenizer_path or args.model_path
    if not has_tokenizer_files(path):
        log.warning("%s has no tokenizer files: only token-id input and output will work", path)
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if args.chat_template:  # --chat-template replaces the tokenizer's (every route and worker reads this one)
        from hybridmoe.chat_templates import load_chat_template

        tokenizer.chat_template = load_chat_template(args.chat_template)
    return tokenizer


def _eos_ids(model_path: str, hf_config, tokenizer) -> list[int]:
    ids: set[int] = set()

    def add(v: object) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))

    add(getattr(hf_config, "eos_token_id", None))
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # only its eos ids are read: its warnings about sampling flags are noise
    try:
        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except Exception:  # no generation_config.json: the config's eos is enough
        pass
    finally:
        hf_logging.set_verbosity(level)
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return sorted(ids)
