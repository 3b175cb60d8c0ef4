"""Server-wide default sampling parameters, as SGLang applies them.

- `--sampling-defaults model` (SGLang's default since 0.5): on the chat routes (/v1/chat/completions and
  /v1/responses), a sampling value the request leaves out takes the model's recommended one from
  generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty: the keys SGLang reads). Qwen3's
  file says temperature 0.6, top_p 0.95, top_k 20: a chat request without them samples with those, as under
  SGLang. `openai`: the built-in defaults (temperature 1, top_p 1, top_k -1, ...).
- `--preferred-sampling-params JSON` (SGLang's flag): defaults for every request, on every route, below the
  request's own values and the chat routes' model values.

So a value is: the request's, else (chat routes) the model's, else the preferred one, else the built-in default.
Both are read and validated at startup: a bad file or flag is one line naming it (exit code 2), never a 400 on
every request later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridmoe.config import ConfigError
from hybridmoe.engine.request import SamplingParams, SamplingParamsError

SAMPLING_DEFAULTS = ("model", "openai")
MODEL_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # SGLang's get_default_sampling_params
GENERATION_CONFIG = "generation_config.json"
MAX_GENERATION_CONFIG_BYTES = 1 << 20  # a few hundred bytes in practice
MAX_PREFERRED_CHARS = 1 << 16
# per-request choices that would change a response's shape or constrain every request: not server-wide defaults
_PER_REQUEST = ("n", "json_schema", "regex", "ebnf", "logit_bias", "sampling_seed", "seed")


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults the routes put under a request's own sampling parameters."""

    chat: dict[str, Any] = field(default_factory=dict)  # the model's values, chat routes only
    preferred: dict[str, Any] = field(default_factory=dict)  # --preferred-sampling-params, every route
    # the flag's text as given: /get_model_info returns it, as SGLang's returns its server argument (a JSON string)
    preferred_text: str | None = None

    def for_chat(self, params: dict[str, Any]) -> dict[str, Any]:
        """A chat route's parameters (the request's, nulls left out) over the model's values."""
        return {**self.chat, **params}

    def for_request(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Any route's parameters over the preferred ones (a non-dict is left for the route to refuse)."""
        if not self.preferred or (params is not None and not isinstance(params, dict)):
            return params
        return {**self.preferred, **(params or {})}


def load_sampling_defaults(model_path: str | None, mode: str = "model",
                           preferred: str | None = None) -> SamplingDefaults:
    """The defaults for `--sampling-defaults mode` with the model at model_path (a directory; a GGUF file or none
    holds no generation_config.json) and `--preferred-sampling-params preferred`; ConfigError naming the flag or
    file and the value at fault."""
    if mode not in SAMPLING_DEFAULTS:
        raise ConfigError(f"--sampling-defaults: got {mode!r}, expected one of {', '.join(SAMPLING_DEFAULTS)}")
    chat = _model_values(Path(model_path) / GENERATION_CONFIG) if mode == "model" and model_path else {}
    return SamplingDefaults(chat=chat, preferred=_preferred(preferred) if preferred is not None else {},
                            preferred_text=preferred)


def _model_values(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    where = f"{path} (the chat routes' default sampling values; --sampling-defaults openai does not read it)"
    try:
        if path.stat().st_size > MAX_GENERATION_CONFIG_BYTES:
            raise ConfigError(f"{where}: larger than {MAX_GENERATION_CONFIG_BYTES >> 10} KiB")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot be read as JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a generation config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    values = {k: data[k] for k in MODEL_KEYS if data.get(k) is not None}
    if values.get("top_k") == 0:  # transformers' "no top-k filtering" is SGLang's -1
        values["top_k"] = -1
    _check(values, where)
    return values


def _preferred(text: str) -> dict[str, Any]:
    flag = "--preferred-sampling-params"
    if len(text) > MAX_PREFERRED_CHARS:
        raise ConfigError(f"{flag}: {len(text)} characters, more than {MAX_PREFERRED_CHARS}")
    try:
        values = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise ConfigError(f"{flag}: not JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{flag}: nested too deeply to be sampling parameters") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{flag}: expected a JSON object of sampling parameters, e.g. "
                          f"'{{\"temperature\": 0.6, \"top_p\": 0.95}}', got {type(values).__name__}")
    fixed = sorted(k for k in values if k in _PER_REQUEST)
    if fixed:
        raise ConfigError(f"{flag}: {', '.join(fixed)}: a request's own choice, not a server-wide default")
    _check(values, flag)
    return values


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _check(values: dict[str, Any], where: str) -> None:
    """SamplingParams' own checks (names, types, ranges), on the values alone."""
    try:
        SamplingParams.from_any(values).validate()
    except SamplingParamsError as e:
        raise ConfigError(f"{where}: {e}") from None
