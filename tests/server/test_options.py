"""Server options: --api-key, --max-queued-requests, refused hybrid flags, load failure, SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hybridmoe.launch_server import build_parser, serve_main, unavailable_flags

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_new_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded_server(start_server):
    srv = start_server("--api-key", KEY, "--max-queued-requests", "2", "--max-running-requests", "1",
                       "--graceful-shutdown-timeout", "0.5")
    yield srv
    srv.stop()


def test_llamafile_without_gguf_is_a_clear_error(capsys):
    # every --kt-method is built now (LLAMAFILE: issue 18); LLAMAFILE needs the GGUF file
    assert serve_main(["--device", "cpu", "--kt-method", "LLAMAFILE"]) == 2
    assert "kt-weight-path" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--kt-method", "AMXINT8"], ["--kt-method", "LLAMAFILE", "--kt-weight-path", "x.gguf"],
                                  ["--kt-method", "BF16", "--kt-num-gpu-experts", "4",
                                  "--kt-max-deferred-experts-per-token", "1", "--kt-cpuinfer", "2"],
                                  ["--kt-num-gpu-experts", "4", "--kt-gpu-prefill-token-threshold", "1024",
                                   "--kt-enable-dynamic-expert-update"], ["--kt-numa-nodes", "0"]])
def test_built_kt_options_are_accepted(argv):
    assert unavailable_flags(argv, build_parser().parse_args(argv)) == []


def test_model_without_config_exits_2_before_listening(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hybridmoe.launch_server", "--device", "cpu", "--port", "0",
                        "--model-path", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines() == [f"hybridmoe serve: error: {tmp_path}: no config.json (expected a Hugging Face "
                                     "model directory)"]


def test_api_key(guarded_server):
    url = guarded_server.url
    assert httpx.get(url + "/health").status_code == 200
    body = {"text": "Return the", "sampling_params": {"max_new_tokens": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/generate", json=body, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.post(url + "/generate", json=body, headers=AUTH).status_code == 200


def test_queue_bound_gives_503(guarded_server):
    url = guarded_server.url
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/generate", json={"text": "a", "rid": "long", "stream": True,
                                                 "sampling_params": LONG}) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(line for line in lines if line.startswith("data:"))  # running
            waiting = [threading.Thread(target=httpx.post, args=(url + "/generate",),
                                        kwargs={"json": {"text": "b", "sampling_params": {"max_new_tokens": 1}},
                                                "headers": AUTH, "timeout": 60})
                       for _ in range(2)]
            for t in waiting:
                t.start()
            deadline = time.time() + 10
            while c.get("/get_server_info").json()["num_queued_streams"] < 2:
                assert time.time() < deadline
                time.sleep(0.05)
            r = c.post("/generate", json={"text": "c", "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 503 and "queued" in r.json()["error"]["message"]
            c.post("/abort_request", json={"rid": "long"})
        for t in waiting:
            t.join(30)
        assert c.post("/generate", json={"text": "d", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_sigterm_ends_running_requests_cleanly(guarded_server):
    events: list[dict] = []

    def consume() -> None:
        with httpx.stream("POST", guarded_server.url + "/generate", headers=AUTH, timeout=60,
                          json={"text": "a", "stream": True, "sampling_params": LONG}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.time() + 20
    while not events:
        assert time.time() < deadline
        time.sleep(0.05)
    guarded_server.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert guarded_server.proc.wait(30) == 0
    assert events[-1]["meta_info"]["finish_reason"]["type"] in ("abort", "length")
    assert guarded_server.error_lines() == []
