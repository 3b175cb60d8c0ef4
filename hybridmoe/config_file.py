"""`hybridmoe serve --config FILE.yaml`: options read from a YAML file, as SGLang's `--config` reads them.

The file is a mapping of option names (`model-path` or `model_path`) to values: a switch takes true or false
(false: left out), a flag of several values a list, a JSON-valued flag (`--preferred-sampling-params`) a mapping.
The options of the command line come after the file's, so they win. Everything is checked before the parser
runs: an unknown option or a value of the wrong shape is one line naming the file and the key (exit code 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from hybridmoe.config import ConfigError
from hybridmoe.sglang_flags import REFUSALS

MAX_CONFIG_BYTES = 1 << 20  # a config file lists a few dozen options
# SGLang's switches that are refused here: parsed as taking any values (so the refusal names them), they are
# switches in SGLang's files all the same: `enable-dp-attention: false` says off, and is left out
_REFUSED_SWITCHES = frozenset(name for flag in REFUSALS if flag.takes == "0" for name in flag.names)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader without aliases: `*name` repeats a node, and a few nested repeats make a value
    exponentially large (a "billion laughs" file of a few hundred bytes)."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with its `--config FILE` (or `--config=FILE`) replaced by the file's options, put first."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ConfigError("--config: given more than once; one config file is read")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise ConfigError("--config: expected a YAML file after it")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    return _options(Path(path), parser) + rest


def _options(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    where = f"--config {path}"
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{where}: larger than {MAX_CONFIG_BYTES >> 10} KiB")
        data = yaml.load(path.read_bytes(), Loader=_Loader)  # noqa: S506 (a safe loader)
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config file") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of option names to values, got {type(data).__name__}")
    out: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            raise ConfigError(f"{where}: the key {key!r} is not an option name")
        option = "--" + key.lstrip("-").replace("_", "-")
        action = parser._option_string_actions.get(option)
        if action is None or option in ("--config", "--help"):
            raise ConfigError(f"{where}: {key}: not an option of {parser.prog}")
        out += _values(where, key, option, action, value)
    return out


def _values(where: str, key: str, option: str, action: argparse.Action, value: object) -> list[str]:
    if action.nargs == 0 or option in _REFUSED_SWITCHES:  # a switch
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: a switch takes true or false, got {value!r}")
        return [option] if value else []
    if value is None:
        raise ConfigError(f"{where}: {key}: no value (leave the option out for its default)")
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(value, list):
        if not many:
            raise ConfigError(f"{where}: {key}: takes one value, got a list")
        return [option, *(_text(where, key, v) for v in value)]
    return [f"{option}={_text(where, key, value)}"]  # one word: a value may start with "-"


def _text(where: str, key: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):  # a JSON-valued option
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:  # YAML's dates, binary, sets have no JSON form
            raise ConfigError(f"{where}: {key}: not a JSON value: {e}") from None
    if isinstance(value, list):
        raise ConfigError(f"{where}: {key}: a list inside a list")
    return str(value)
