"""config.json -> transformers config, the way hybridmoe reads it.

hybridmoe implements its model families itself, so the config is always read with the class
transformers ships for its model type, never the checkpoint's own configuration code (its
`auto_map`): with `--trust-remote-code`, given for a remote-code tokenizer, AutoConfig would
otherwise switch to code written for another transformers version, with other field names.

Some checkpoints publish a model type transformers does not know for an architecture it does:
Kimi-K2's `model_type: kimi_k2` is `DeepseekV3ForCausalLM` with DeepSeek-V3's config fields (its
own configuration_deepseek.py is a copy of DeepSeek's), so it is read as `deepseek_v3`, and needs
no `--trust-remote-code`. Only a model type unknown to transformers and without an alias goes to
AutoConfig, which runs the checkpoint's code when `trust_remote_code` allows it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# published model type -> the transformers model type whose config class reads it
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def native_model_type(model_type: str | None) -> str | None:
    """The transformers model type a config.json's `model_type` is read as (itself when not aliased)."""
    return MODEL_TYPE_ALIASES.get(model_type, model_type) if model_type is not None else None


def load_config(model_path: str | Path, trust_remote_code: bool = False) -> Any:
    """The transformers config of a local model directory (config.json must exist; its errors are
    the caller's to name). A model type transformers knows, or an alias of one, is built with
    transformers' own config class; anything else through AutoConfig."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(model_path)
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    native = native_model_type(model_type)
    if not isinstance(native, str) or native not in CONFIG_MAPPING:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    cls = CONFIG_MAPPING[native]
    config_dict, kwargs = cls.get_config_dict(str(path))
    if native != model_type:
        # read under the native type: transformers would warn that the types differ, and its
        # from_pretrained would check the published type against the class
        log.info("%s: model_type %r is read as transformers' %s config (%s)", path / "config.json", model_type,
                 native, cls.__name__)
        config_dict = {**config_dict, "model_type": native}
    return cls.from_dict(config_dict, **kwargs)
