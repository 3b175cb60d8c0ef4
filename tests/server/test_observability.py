"""What a real server (demo model, hybrid split on the CPU) tells its operator: one log format, the
load progress bar, the startup summary, decode and request log lines, the new metrics, and the
information / expert-record endpoints and CORS."""

from __future__ import annotations

import json
import re

import httpx
import pytest

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
ORIGIN = "http://example.com"


@pytest.fixture(scope="module")
def obs(start_server):
    srv = start_server("--enable-metrics", "--log-requests", "--decode-log-interval", "4", "--kt-num-gpu-experts",
                       "2", "--kt-cpuinfer", "1", "--served-model-name", "demo", "--allowed-origins", ORIGIN)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for i in range(3):
            r = c.post("/generate", json={"text": f"Hello number {i}", "sampling_params":
                                          {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
        yield srv, c


def test_startup_summary_progress_and_one_log_format(obs):
    srv, _ = obs
    log = srv.log()
    assert "Loading weights: 100%" in log and "GB/s" in log  # the progress bar, with bytes and rate
    assert re.search(r"hybridmoe.startup: model .*demo_model \(Qwen3MoeForCausalLM, float32 on cpu\), context", log)
    assert re.search(r"hybridmoe.startup: KV cache: \d+ pages of 16 tokens", log)
    assert "experts: MoE layers 0-3: 2 of 8 on the GPU (torch), 6 on the CPU; placement uniform" in log
    assert re.search(r"CPU experts: --kt-method AMXINT8, 1 threads in 1 sub-pool\(s\), ISA path \w+; deferred", log)
    assert "CUDA graphs: off" in log
    assert re.search(r"overlap scheduling: (off|on \(--disable-overlap-schedule turns it off\))", log)
    # uvicorn's lines in our format too ("Uvicorn running on", "Application startup complete")
    uvicorn = [x for x in log.splitlines() if "Application startup complete" in x]
    assert uvicorn and all(LINE.match(x) for x in uvicorn), uvicorn
    lines = [x for x in log.splitlines() if x and not x.startswith("Loading weights") and "\r" not in x]
    assert all(LINE.match(x) for x in lines), [x for x in lines if not LINE.match(x)][:5]


def test_decode_and_request_log_lines(obs):
    srv, _ = obs
    log = srv.log()
    decode = [x for x in log.splitlines() if "Decode batch." in x]
    assert decode, log[-2000:]
    assert re.search(r"Decode batch\. #running-req: \d+, #token: \d+, token usage: \d\.\d\d, cache hit rate: "
                     r"[\d.]+%, gen throughput \(token/s\): [\d.]+, #queue-req: \d+, CPU expert time/step: [\d.]+ ms, "
                     r"GPU expert hits: [\d.]+%", decode[0]), decode[0]
    assert len(re.findall(r"hybridmoe.requests: Receive: rid=\w+, prompt_tokens=\d+", log)) >= 3
    finish = re.findall(r"hybridmoe.requests: Finish: rid=\w+, .*completion_tokens=10, .*e2e_latency=.*text=", log)
    assert len(finish) >= 3


def test_new_metrics(obs):
    _, c = obs
    text = c.get("/metrics").text
    for name in ("sglang:cache_hit_rate", "sglang:max_total_num_tokens", "sglang:num_retracted_reqs",
                 "sglang:queue_time_seconds_count", "hybridmoe:cpu_expert_time_per_step_seconds",
                 "hybridmoe:gpu_expert_hit_share", "hybridmoe:deferred_experts_per_token",
                 "hybridmoe:layerwise_prefills"):
        assert re.search(rf"^{re.escape(name)}{{model_name=\"demo\"}} [\d.e+-]+$", text, re.M), name
    share = float(re.search(r"^hybridmoe:gpu_expert_hit_share\{[^}]*\} ([\d.e+-]+)$", text, re.M).group(1))
    assert 0.0 < share < 1.0  # 2 of 8 experts on the GPU side: some hits, not all
    n = float(re.search(r"^sglang:queue_time_seconds_count\{[^}]*\} ([\d.]+)$", text, re.M).group(1))
    assert n >= 3


def test_info_routes(obs):
    _, c = obs
    r = c.get("/v1/models/demo")
    assert r.status_code == 200 and r.json()["id"] == "demo" and r.json()["object"] == "model"
    r = c.get("/v1/models/not-this-one")
    assert r.status_code == 404 and "not-this-one" in r.json()["error"]["message"]
    load = c.get("/get_load").json()
    assert isinstance(load, list) and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    assert c.get("/model_info").json() == c.get("/get_model_info").json()
    info = c.get("/server_info").json()
    assert info["served_model_name"] == "demo" and "max_total_num_tokens" in info and "version" in info


def test_expert_distribution_record_roundtrip(obs, tmp_path):
    _, c = obs
    assert c.post("/start_expert_distribution_record").json()["success"]
    r = c.post("/generate", json={"text": "count my experts", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert r.status_code == 200
    assert c.post("/stop_expert_distribution_record").json()["success"]
    out = tmp_path / "dist.json"
    r = c.post("/dump_expert_distribution_record", json={"path": str(out)})
    assert r.status_code == 200 and r.json()["path"] == str(out), r.text
    data = json.loads(out.read_text())
    assert data["format"] == "hybridmoe-expert-distribution" and data["num_experts"] == 8
    counts = data["counts"]
    assert sorted(counts) == ["0", "1", "2", "3"]
    # the record holds only that request: its prompt and 4 tokens' forwards, top-k 2 per token
    total = sum(counts["0"])
    prompt = len(c.post("/tokenize", json={"prompt": "count my experts"}).json()["tokens"])
    assert total == 2 * (prompt + 3), (total, prompt)
    # the file is what --init-expert-location reads
    from hybridmoe.moe.placement import place_experts

    masks = place_experts("frequency", [0, 1, 2, 3], 8, 2, str(out))
    assert all(int(m.sum()) == 2 for m in masks.values())
    r = c.post("/dump_expert_distribution_record", json={"path": str(tmp_path / "no" / "such" / "dir.json")})
    assert r.status_code == 400


def test_cors(obs):
    _, c = obs
    r = c.options("/generate", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = c.get("/health", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_off_by_default(http):
    r = http.options("/generate", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
