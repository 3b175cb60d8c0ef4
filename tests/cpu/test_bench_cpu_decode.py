"""Smoke test of benchmarks/bench_cpu_decode.py (tiny shape, no llama.cpp) and of its GGUF writer:
the script runs end to end in a subprocess (it sets torch's thread count) and reports its numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_decode_tiny(tmp_path):
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_decode.py"), "--tiny", "--no-llama",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["tokens_per_s"] > 0 and r["stream_read_bps"] > 0 and 0 < r["ratio_to_bound"]
    assert r["bytes_per_token"] > 0 and r["load_s"] > 0
    assert "of the bound" in res.stdout
    # the bound counts the KV cache the timed steps read: --tiny's 2 layers x 2 kv heads x 32 dims, prompt 8, 4 steps
    assert r["kv_bytes_per_token"] == int(2 * (2 * 2 * 32 * 2) * (8 + 1.5))
    assert r["bytes_per_token"] == r["weight_bytes_per_token"] + r["kv_bytes_per_token"]
    assert r["prefill_tokens_per_s"] > 0 and "prefill of 8 tokens" in res.stdout


def test_bench_cpu_decode_pin_modes(tmp_path):
    """The caller-pin modes alternate in one run (each sets and resets the pin and the leader's spin)."""
    from hybridmoe.cpu import caller_pin

    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_decode.py"), "--tiny", "--no-llama",
                          "--repeats", "2", "--dense", "on,pin,nopin,pinned0,classic,pf0,pf4096,attn2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["caller_pin_default"] == caller_pin.wanted()
    assert set(r["by_dense_mode"]) == {"on", "pin", "nopin", "pinned0", "classic", "pf0", "pf4096", "attn2"}
    assert all(v["tokens_per_s"] > 0 for v in r["by_dense_mode"].values())


def test_bench_cpu_decode_bad_mode_is_one_usage_line():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_decode.py"), "--tiny", "--no-llama",
                          "--dense", "on,fast"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2
    assert "unknown mode(s) fast" in res.stderr and "Traceback" not in res.stderr


def test_gguf_of_the_shape(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    # importing the script sets OMP_WAIT_POLICY=PASSIVE (for its own process): put it back after this
    # test, or every later CPU-only LLM of this process would set torch's thread count at construction
    # (engine/model_runner.py) and two models built one after the other could differ in the last bits
    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # records the value before (an absent one too) for the undo
    monkeypatch.delenv("OMP_WAIT_POLICY")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_cpu_decode import TINY
        from bench_decode import add_shape_args, parse_shape_args
        from llama_cpp_ref import write_gguf
    finally:
        sys.path.pop(0)
    import argparse

    p = argparse.ArgumentParser()
    add_shape_args(p)
    a = parse_shape_args(p, TINY)
    path = write_gguf(tmp_path / "m.gguf", a)
    rd = gguf.GGUFReader(str(path))
    t = {x.name: x for x in rd.tensors}
    assert len(t) == 3 + 12 * a.layers
    gate = t["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(gate.shape) == [a.hidden, a.inter, a.experts]  # ggml order
    assert str(rd.fields["tokenizer.ggml.model"].contents()) == "none"
