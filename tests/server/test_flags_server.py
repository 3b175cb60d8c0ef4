"""`serve` flags on real servers (subprocesses, demo model, CPU):
- the kt-sglang guide's `python -m sglang.launch_server ...` line with only the program name and the
  paths changed (model, converted CPU experts; host and port for the test) starts and answers /generate;
- one server with every implemented serving flag: FP8 KV cache, lpm, stream interval, request logs,
  cache report, auto-truncate, chat template, decode-log interval, an SGLang attention-backend name;
- Hub ids: a cached snapshot (--revision, --download-dir) is served offline; one not cached is a one-line
  error naming the id, exit code 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import DEMO, REPO, ServerProcess, free_port

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


class _Exact(ServerProcess):
    """A server started with exactly `argv` after the program name (no --device added)."""

    def __init__(self, log_path: Path, argv: list[str], port: int) -> None:  # noqa: D107
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridmoe.launch_server", *argv], cwd=REPO,
                                     stdout=self._log, stderr=subprocess.STDOUT, env=ENV)


@pytest.fixture(scope="module")
def kt_weights(tmp_path_factory) -> Path:
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model hybridmoe/demo_model is not built")
    out = tmp_path_factory.mktemp("kt") / "demo-int4"
    r = subprocess.run([sys.executable, "-m", "hybridmoe.convert", "--input-path", str(DEMO), "--output", str(out),
                        "--quant-method", "int4", "--no-progress", "--threads", "1"], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_seed_guide_command_line(kt_weights, tmp_path) -> None:
    port = free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port), "--model", str(DEMO), "--kt-weight-path", str(kt_weights),
            "--kt-cpuinfer", "64", "--kt-threadpool-count", "2", "--kt-num-gpu-experts", "32", "--kt-method",
            "AMXINT4", "--attention-backend", "flashinfer", "--trust-remote-code", "--mem-fraction-static", "0.80",
            "--chunked-prefill-size", "16384", "--max-running-requests", "4", "--max-total-tokens", "32000",
            "--enable-mixed-chunk", "--tensor-parallel-size", "1", "--enable-p2p-check",
            "--disable-shared-experts-fusion", "--served-model-name", "Qwen3"]
    srv = _Exact(tmp_path / "seed.log", argv, port)
    try:
        srv.wait_healthy()
        r = httpx.post(srv.url + "/generate", json={"text": "The module", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] >= 1
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "Qwen3"
    finally:
        assert srv.stop() == 0
    log = srv.log_path.read_text()
    assert "--attention-backend flashinfer: running hybridmoe's torch attention backend" in log
    assert "--kt-cpuinfer 64 is above" in log and "unrecognized" not in log
    assert [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line] == []


@pytest.fixture(scope="module")
def flags_server(start_server):
    return start_server("--kv-cache-dtype", "fp8_e5m2", "--schedule-policy", "lpm", "--stream-interval", "3",
                        "--log-requests", "--log-requests-level", "3", "--enable-cache-report",
                        "--allow-auto-truncate", "--context-length", "64", "--chat-template", "chatml",
                        "--decode-log-interval", "5", "--watchdog-timeout", "120", "--attention-backend",
                        "torch_native", "--served-model-name", "flags")


def test_flags_server_startup_and_info(flags_server) -> None:
    log = flags_server.log()
    assert "--attention-backend torch_native: running hybridmoe's torch attention backend" in log
    assert "float8_e5m2); context length 64" in log
    info = httpx.get(flags_server.url + "/get_server_info").json()
    assert (info["kv_cache_dtype"], info["schedule_policy"], info["decode_log_interval"]) == ("fp8_e5m2", "lpm", 5)
    assert (info["stream_interval"], info["watchdog_timeout"], info["enable_cache_report"]) == (3, 120.0, True)


def test_generate_and_request_log_lines(flags_server) -> None:
    r = httpx.post(flags_server.url + "/generate", json={"text": "Return the", "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["meta_info"]["id"]
    log = flags_server.log()
    received = [line for line in log.splitlines() if f"Receive: rid={rid}," in line]
    finished = [line for line in log.splitlines() if f"Finish: rid={rid}," in line]
    assert len(received) == 1 and "sampling_params={" in received[0] and "input_ids=[" in received[0]
    assert len(finished) == 1 and "completion_tokens=3" in finished[0] and "output_ids=[" in finished[0]
    assert f"text={r.json()['text']!r}" in finished[0]


def test_stream_interval_on_the_wire(flags_server) -> None:
    body = {"text": "Return the", "stream": True, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    counts = []
    with httpx.stream("POST", flags_server.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                counts.append(json.loads(line[6:])["meta_info"]["completion_tokens"])
    assert counts[-1] == 10 and len(counts) <= 5, counts
    assert all(b - a >= 3 for a, b in zip(counts[:-2], counts[1:-1])), counts  # every 3 tokens but the last


def test_auto_truncate(flags_server) -> None:
    r = httpx.post(flags_server.url + "/generate", json={"text": "word " * 200, "sampling_params": {
        "max_new_tokens": 8}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] == 63  # the first context - 1 tokens
    assert "keeping the first 63 (--allow-auto-truncate)" in flags_server.log()


def test_cache_report(flags_server) -> None:
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " * 2
    usages = []
    for _ in range(2):
        r = httpx.post(flags_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 16  # the first prompt's full pages


def test_chat_template_flag(flags_server) -> None:
    from transformers import AutoTokenizer

    from hybridmoe.chat_templates import BUILTIN_TEMPLATES
    from hybridmoe.server.templates import render_chat

    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(flags_server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    text = render_chat(BUILTIN_TEMPLATES["chatml"], messages, add_generation_prompt=True,
                       continue_final_message=False, variables={})
    want = len(AutoTokenizer.from_pretrained(str(DEMO)).encode(text, add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens"] == want


def _cached_hub(tmp_path: Path) -> Path:
    """A Hugging Face cache holding the demo model as hmtest-org/demo at revision v1."""
    repo = tmp_path / "hub" / "models--hmtest-org--demo"
    shutil.copytree(DEMO, repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(SNAPSHOT)
    return tmp_path / "hub"


def test_hub_id_from_the_cache_offline(tmp_path) -> None:
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model hybridmoe/demo_model is not built")
    hub = _cached_hub(tmp_path)
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "--device", "cpu", "--model-path",
                        "hmtest-org/demo", "--revision", "v1", "--download-dir", str(hub), "--max-new-tokens", "2",
                        "--prompt", "The"], cwd=REPO, env=dict(ENV, HF_HUB_OFFLINE="1"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[2 tokens" in r.stdout
    assert f"--model-path hmtest-org/demo at revision v1: using {hub}" in r.stderr


@pytest.mark.parametrize("argv", [["--model-path", "hmtest-org/not-cached"],
                                  ["--model-path", "hmtest-org/demo", "--revision", "v2"]], ids=["id", "revision"])
def test_hub_id_offline_not_cached_is_one_line(tmp_path, argv: list[str]) -> None:
    hub = _cached_hub(tmp_path)
    r = subprocess.run([sys.executable, "-m", "hybridmoe.launch_server", "--device", "cpu", "--port", "0", *argv,
                        "--download-dir", str(hub)], cwd=REPO, env=dict(ENV, HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hybridmoe serve: error: --model-path {argv[1]}: not a local directory and not in "
                               f"the Hugging Face cache {hub}")
    assert "offline?" in lines[0] and f"huggingface-cli download {argv[1]}" in lines[0]


def test_hub_id_through_the_python_api_offline(tmp_path) -> None:
    """hybridmoe.LLM takes a Hub id as the command line does (it was "no such directory")."""
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model hybridmoe/demo_model is not built")
    hub = _cached_hub(tmp_path)
    code = ("from hybridmoe import LLM\n"
            f"llm = LLM('hmtest-org/demo', revision='v1', download_dir={str(hub)!r}, device='cpu', progress=False)\n"
            "print('ids', len(llm.generate('The', {'max_new_tokens': 2})['output_ids']), llm.args.model_path)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(ENV, HF_HUB_OFFLINE="1"), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ids 2 {hub}" in r.stdout, r.stdout
