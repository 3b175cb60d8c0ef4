"""Server-wide default sampling parameters (server/sampling_defaults.py), as SGLang applies them:
`--sampling-defaults model` (its default) puts the model's generation_config.json values under a chat request's
own (/v1/chat/completions, /v1/responses; not /v1/completions or /generate), `--preferred-sampling-params` puts
its values under every request's. A value is the request's, else the model's (chat), else the preferred one,
else the built-in default. Bad files and flags are one line at startup (exit code 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from hybridmoe.config import ConfigError, ServerConfig
from hybridmoe.launch_server import serve_main
from hybridmoe.server.sampling_defaults import load_sampling_defaults
from tests.server.conftest import DEMO
from tests.server.inproc import demo_engine, serve_in_thread

# the demo model's generation_config.json (also: do_sample, max_new_tokens, eos ids: not sampling defaults)
DEMO_VALUES = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
UNSET = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _model_dir(tmp_path: Path, config: object) -> Path:
    d = tmp_path / "m"
    d.mkdir(parents=True)
    (d / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def test_the_model_values_are_the_five_sglang_reads(tmp_path):
    d = _model_dir(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "do_sample": True,
                              "max_new_tokens": 64, "repetition_penalty": None, "eos_token_id": [1, 2]})
    got = load_sampling_defaults(str(d))
    assert got.chat == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0} and got.preferred == {}
    assert load_sampling_defaults(str(d), "openai").chat == {}
    assert load_sampling_defaults(str(tmp_path)).chat == {}  # no file: none
    assert load_sampling_defaults(None).chat == {}
    assert load_sampling_defaults(str(_model_dir(tmp_path / "k0", {"top_k": 0}))).chat == {"top_k": -1}  # HF: off
    assert load_sampling_defaults(str(DEMO)).chat == DEMO_VALUES


@pytest.mark.parametrize("config, words", [
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"temperature": "hot"}, "temperature='hot' is invalid"),
    ({"top_p": 1.5}, "top_p=1.5 is invalid"),
    ({"top_k": 2.5}, "top_k=2.5 is invalid"),
    ({"temperature": float("nan")}, "temperature=nan is invalid"),
    ({"repetition_penalty": -1}, "repetition_penalty=-1 is invalid"),
    ("{" + " " * (1 << 20) + "}", "larger than 1024 KiB"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_a_bad_generation_config_is_one_line_naming_it(tmp_path, config, words):
    d = _model_dir(tmp_path, config)
    with pytest.raises(ConfigError) as e:
        load_sampling_defaults(str(d))
    message = str(e.value)
    assert str(d / "generation_config.json") in message and words in message and "\n" not in message, message
    assert load_sampling_defaults(str(d), "openai").chat == {}  # openai does not read it


def test_preferred_values_are_checked():
    got = load_sampling_defaults(None, "openai", '{"temperature": 0.3, "max_new_tokens": 7, "stop": ["x"]}')
    assert got.preferred == {"temperature": 0.3, "max_new_tokens": 7, "stop": ["x"]}
    for text, words in [("{", "not JSON"), ("[1]", "expected a JSON object"), ('{"n": 2}', "n: a request's own"),
                        ('{"json_schema": "{}", "seed": 1}', "json_schema, seed: a request's own"),
                        ('{"temperature": -1}', "temperature=-1 is invalid"), ('{"top_p": NaN}', "NaN is not"),
                        ('{"colour": 1}', "unknown sampling parameter(s) ['colour']"),
                        ("{" + " " * 70000 + "}", "more than 65536"),
                        ("[" * 30000 + "]" * 30000, "nested too deeply")]:
        with pytest.raises(ConfigError) as e:
            load_sampling_defaults(None, "openai", text)
        assert str(e.value).startswith("--preferred-sampling-params: ") and words in str(e.value), (text, e.value)
    with pytest.raises(ConfigError, match="--sampling-defaults: got 'hf'"):
        load_sampling_defaults(None, "hf")


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


@pytest.fixture
def seen(engine, monkeypatch) -> list[dict]:
    """The sampling parameters each request reached the engine with."""
    got: list[dict] = []
    real = engine.make_request

    def recording(*args, **kwargs):
        got.append(dict(kwargs.get("sampling_params") or {}))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "make_request", recording)
    return got


def _ask_every_route(url: str, chat_extra: dict | None = None) -> dict[str, httpx.Response]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **(chat_extra or {})}
    return {
        "chat": httpx.post(url + "/v1/chat/completions", json=chat, timeout=60),
        "responses": httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 3}, timeout=60),
        "completions": httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60),
        "generate": httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}},
                               timeout=60),
    }


def _unset(params: dict) -> dict:
    return {k: params[k] for k in UNSET if k in params}


def test_model_values_reach_the_chat_routes_only(engine, seen):
    with serve_in_thread(lambda args: engine) as url:  # ServerConfig's default: --sampling-defaults model
        answers = _ask_every_route(url)
        assert all(r.status_code == 200 for r in answers.values()), {k: r.text for k, r in answers.items()}
        chat, responses, completions, generate = (_unset(p) for p in seen)
        assert chat == DEMO_VALUES and responses == DEMO_VALUES
        assert completions == {} and generate == {}
        seen.clear()
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "top_k": 3})
        assert r.status_code == 200 and _unset(seen[0]) == dict(DEMO_VALUES, temperature=0, top_k=3)
        assert httpx.get(url + "/get_model_info").json()["preferred_sampling_params"] is None


def test_openai_defaults_and_preferred_values(engine, seen):
    preferred = {"temperature": 0.3, "top_k": 5, "max_new_tokens": 4}
    server = ServerConfig(sampling_defaults="openai", preferred_sampling_params=json.dumps(preferred))
    with serve_in_thread(lambda args: engine, server=server) as url:
        answers = _ask_every_route(url)
        assert all(r.status_code == 200 for r in answers.values())
        for params in seen:  # no model values; the preferred ones under each request's own
            assert _unset(params) == {"temperature": 0.3, "top_k": 5}
        out = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"ignore_eos": True}}).json()
        assert len(out["output_ids"]) == 4  # the preferred max_new_tokens (the built-in one is 128)
        # SGLang's /get_model_info gives the flag's own text (a JSON string), not an object
        assert httpx.get(url + "/get_model_info").json()["preferred_sampling_params"] == json.dumps(preferred)
    seen.clear()
    server = ServerConfig(preferred_sampling_params=json.dumps(dict(preferred, min_p=0.05)))
    with serve_in_thread(lambda args: engine, server=server) as url:  # model values beat the preferred ones
        answers = _ask_every_route(url, {"top_p": 0.5})
        assert all(r.status_code == 200 for r in answers.values())
        chat, responses, completions, generate = (_unset(p) for p in seen[:4])
        assert chat == dict(DEMO_VALUES, top_p=0.5, min_p=0.05) and responses == dict(DEMO_VALUES, min_p=0.05)
        assert completions == generate == {"temperature": 0.3, "top_k": 5, "min_p": 0.05}


def test_serve_refuses_a_bad_file_or_flag_at_startup(tmp_path, capsys):
    model = tmp_path / "demo"
    shutil.copytree(DEMO, model)

    def serve(*extra: str) -> str:
        rc = serve_main(["--model-path", str(model), "--device", "cpu", "--port", "0", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1, (rc, err)
        return err

    assert "--preferred-sampling-params: n: a request's own" in serve("--preferred-sampling-params", '{"n": 3}')
    (model / "generation_config.json").write_text('{"temperature": -2}')
    err = serve()
    assert f"{model / 'generation_config.json'}" in err and "temperature=-2 is invalid" in err
