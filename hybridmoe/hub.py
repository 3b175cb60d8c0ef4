"""Hugging Face Hub ids as `--model-path` / `--tokenizer-path`: resolved to a local snapshot through
huggingface_hub (`--revision`, `--download-dir`), before any other startup check reads the files.

A path that exists is used as it is; a value that is not a path and not shaped like a Hub id
(`org/name`) is left alone, so the usual "no config.json" message names it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from hybridmoe.config import ConfigError, EngineArgs

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# what the engine reads of a model repository (no .bin/.pth/.gguf duplicates of the safetensors)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken", "*.vocab"]


def is_hub_id(value: str) -> bool:
    """Shaped like `org/name` and not an existing path."""
    return bool(_REPO_ID.match(value)) and not Path(value).exists() and not value.startswith((".", "/", "~"))


def download(repo_id: str, revision: str | None, cache_dir: str | None, flag: str = "--model-path") -> str:
    """The local snapshot directory of repo_id (downloaded when missing); ConfigError naming the id."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ConfigError(f"{flag} {repo_id}: not a local directory, and huggingface_hub is not installed to "
                          "download it") from None
    at = f" at revision {revision}" if revision else ""
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                                 allow_patterns=ALLOW_PATTERNS)
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{flag} {repo_id}: not a local directory, and the Hugging Face Hub has no such model "
                          "(or it is gated/private: log in with `huggingface-cli login`)") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{flag} {repo_id}: the Hugging Face Hub has no revision {revision!r} of it") from None
    except Exception as e:  # offline (no network, HF_HUB_OFFLINE=1) and not in the cache
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"{flag} {repo_id}: not a local directory and not in the Hugging Face cache"
                          f"{' ' + cache_dir if cache_dir else ''}{at}, and downloading it failed (offline?): "
                          f"{reason}. Download it where the Hub is reachable (`huggingface-cli download {repo_id}`) "
                          "or pass a local directory") from None
    log.info("%s %s%s: using %s", flag, repo_id, at, path)
    return path


def resolve_hub_paths(args: EngineArgs) -> EngineArgs:
    """args with a Hub id in model_path / tokenizer_path replaced by its local snapshot directory."""
    changes = {}
    for field, flag in (("model_path", "--model-path"), ("tokenizer_path", "--tokenizer-path")):
        value = getattr(args, field)
        if isinstance(value, str) and is_hub_id(value):  # (the Python API may pass a Path: a local one)
            changes[field] = download(value, args.revision, args.download_dir, flag)
    if not changes:
        return args
    if "model_path" in changes and args.served_model_name is None:
        changes["served_model_name"] = args.model_path  # the id, as SGLang names it, not the cache path
    return dataclasses.replace(args, **changes)
