"""Session 40 review: bugs found in the features of sessions 38-39 (--config, --preferred-sampling-params)."""

from __future__ import annotations

import json

import httpx
import pytest

from hybridmoe.config import ServerConfig
from hybridmoe.config_file import expand_config_file
from hybridmoe.launch_server import build_parser
from hybridmoe.sglang_compat import refused
from tests.server.inproc import demo_engine, serve_in_thread


def _parse(tmp_path, text: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    parser = build_parser()
    return parser.parse_args(expand_config_file(["--config", str(path)], parser))


def test_config_false_on_a_refused_sglang_switch_leaves_it_out(tmp_path):
    """An SGLang config file says `enable-dp-attention: false` (the feature off): SGLang leaves a false switch
    out, so must hybridmoe; it was passed as `--enable-dp-attention=false` and the server refused to start."""
    ns = _parse(tmp_path, "model-path: /m\nenable-dp-attention: false\nenable-torch-compile: false\n")
    assert refused(ns) == []
    ns = _parse(tmp_path, "model-path: /m\nenable-dp-attention: true\n")  # on: still refused, naming it
    assert [line.split(":")[0] for line in refused(ns)] == ["--enable-dp-attention"]


def test_config_a_refused_sglang_switch_takes_true_or_false_only(tmp_path):
    from hybridmoe.config import ConfigError

    with pytest.raises(ConfigError, match="enable-dp-attention: a switch takes true or false"):
        _parse(tmp_path, "enable-dp-attention: 3\n")


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


def test_health_generate_is_not_broken_by_preferred_sampling_params(engine):
    """--preferred-sampling-params '{"min_new_tokens": 8}' (valid alone, checked at startup) went under
    /health_generate's own one-token request: min_new_tokens 8 > max_new_tokens 1, a 400 on every probe."""
    server = ServerConfig(preferred_sampling_params=json.dumps({"min_new_tokens": 8}))
    with serve_in_thread(lambda args: engine, server=server) as url:
        r = httpx.get(url + "/health_generate", timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["{temperature: 2024-01-01}", "{temperature: !!binary aGVsbG8=}",
                                   "{2024-01-01: 1}"])
def test_config_a_mapping_without_a_json_form_is_one_line(tmp_path, value):
    """A YAML mapping given to a JSON-valued option holding a date or binary: json.dumps raised TypeError, a
    traceback out of `hybridmoe serve --config`."""
    from hybridmoe.config import ConfigError

    with pytest.raises(ConfigError, match="preferred-sampling-params: not a JSON value"):
        _parse(tmp_path, f"preferred-sampling-params: {value}\n")


def test_a_preferred_value_at_fault_is_named_as_the_servers(engine):
    """A 400 caused by a --preferred-sampling-params value the client never sent says so (it named `min_tokens`
    alone, a field the client had not set); one the client sent itself is reported as before."""
    server = ServerConfig(preferred_sampling_params=json.dumps({"min_new_tokens": 8}))
    with serve_in_thread(lambda args: engine, server=server) as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "min_tokens=8" in msg and "the server's --preferred-sampling-params value" in msg
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2, "min_tokens": 5})
        assert r.status_code == 400
        assert "preferred" not in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 9})
        assert r.status_code == 200
