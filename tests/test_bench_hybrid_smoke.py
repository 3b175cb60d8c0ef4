"""bench_hybrid_decode.py runs end to end (a tiny model on the CPU, `--device cpu`): the script the
H200 runs is not first exercised on the device. It checks the script, not the numbers. And the
benchmark shapes of DeepSeek-V3 and Kimi-K2 (benchmarks/shapes.py): the published values, --layers
cutting the depth, each script's flags."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmoe.cpu.settings import CPUEngineSettings

REPO = Path(__file__).resolve().parents[1]


def test_extrapolation_to_more_moe_layers():
    """bench_hybrid_decode.extrapolate: the step plus the missing layers at the measured period; the bound's bytes
    scale with the layers."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_hybrid_decode import extrapolate

    row = {"batch": 1, "ms_per_step": 22.0, "cpu_trace": {"release_interval_us": 3000.0},
           "adjacent_probes_gbps": [100.0, 120.0], "cpu_expert_bytes_per_token": 6 * 300e6}
    out = extrapolate(row, n_moe=6, target=58)
    assert out["extrapolated_ms_per_step"] == pytest.approx(22.0 + 52 * 3.0)
    assert out["extrapolated_tokens_per_s"] == pytest.approx(1e3 / 178.0)
    # 58 layers of 300 MB at 110 GB/s take 158.2 ms: that over 178 ms
    assert out["extrapolated_ratio_to_adjacent_bound"] == pytest.approx(58 * 300e6 / 110e9 / 0.178)
    assert extrapolate({**row, "cpu_trace": {"release_interval_us": float("nan")}}, 6, 58) == {}


def test_bench_hybrid_decode_smoke(tmp_path):
    out = tmp_path / "hb.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_hybrid_decode.py"), "--device", "cpu",
           "--layers", "2", "--experts", "8", "--topk", "2", "--hidden", "64", "--inter", "64", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "16", "--vocab", "128", "--gpu-experts", "2", "--deferred", "0", "1",
           "--batch", "1", "--graphs", "off", "--off-steps", "3", "--prompt-len", "8", "--blocking-sync", "on",
           "--hostfn-spin-us=-1", "--repeat", "2", "--fuse", "on,quant", "--stream-wait", "memop",
           "--merge-deferred", "on,off",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["runs"]
    # the grid twice, interleaved: (repeat, deferral, merged or not (with deferral only), fuse mode)
    assert [(r["rep"], r["deferred"], r["merge_deferred"], r["fuse"]) for r in rows] == [
        (rep, d, m, fr) for rep in (0, 1) for d in (0, 1) for m in (("on", "off") if d else ("on",))
        for fr in ("on", "quant")]
    assert all(r["hostfn_spin_us"] == -1 and r["stream_wait"] == "memop" for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["cpu_tasks_per_step"] > 0
        # every layer's task traced: 2 MoE layers (+1 deferred) per step, 3 steps and more
        assert r["cpu_trace"]["tasks"] >= 3 * (2 + r["deferred"]) and r["cpu_trace"]["run_us"] > 0
        assert 0 < r["ratio_to_best_probe_bound"] <= r["ratio_to_bound"] * 1.0001
        lo, hi = sorted(r["adjacent_probes_gbps"])
        assert r["ratio_to_bound"] * r["stream_read_gbps"] / hi * 0.9999 <= r["ratio_to_adjacent_bound"]
        assert r["ratio_to_adjacent_bound"] <= r["ratio_to_bound"] * r["stream_read_gbps"] / lo * 1.0001
    assert "CPU trace:" in proc.stdout
    summary = {(e["deferred"], e["merge_deferred"], e["fuse"]): e for e in res["summary"]}
    assert sorted(summary) == [(0, "on", "on"), (0, "on", "quant"), (1, "off", "on"), (1, "off", "quant"),
                               (1, "on", "on"), (1, "on", "quant")]
    for (d, m, fr), e in summary.items():
        vals = sorted(r["tokens_per_s"] for r in rows
                      if r["deferred"] == d and r["merge_deferred"] == m and r["fuse"] == fr)
        assert e["runs"] == 2 and e["median_tokens_per_s"] == (vals[0] + vals[1]) / 2
    assert "median" in proc.stdout and "fuse quant" in proc.stdout and "wait memop" in proc.stdout
    assert "unmerged" in proc.stdout


def test_bench_hybrid_decode_from_gguf_experts(tmp_path):
    """--gguf Q8_0: the experts come from a GGUF file the script writes (random Q8_0 blocks,
    gguf_experts_file.py) and run as --kt-method LLAMAFILE: the bytes a token reads are the GGUF
    blocks' (AMXINT8's packing would give other bytes); a second run reuses the file."""
    out, where = tmp_path / "hb.json", tmp_path / "g"
    h, i, e, k, gpu, layers = 256, 256, 8, 2, 3, 2  # the GGUF kernels take multiples of 256
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_hybrid_decode.py"), "--device", "cpu",
           "--layers", str(layers), "--experts", str(e), "--topk", str(k), "--hidden", str(h), "--inter", str(i),
           "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "128", "--gpu-experts", str(gpu),
           "--deferred", "0", "--batch", "1", "--graphs", "off", "--off-steps", "3", "--prompt-len", "8",
           "--gguf", "Q8_0", "--gguf-dir", str(where), "--out", str(out)]
    for run in range(2):  # the second run also A/Bs the next-block prefetch, the item size and the prefetch distance
        ab = ["--block-prefetch", "1,0", "--items-per-thread", "8,2", "--prefetch", "4096,0"] if run else []
        proc = subprocess.run(cmd + ab, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ("gguf experts:" in proc.stdout) == (run == 0)
        assert (" bp 0 " in proc.stdout) == (run == 1) and (" ipt 2 " in proc.stdout) == (run == 1)
        assert (" pf 0 " in proc.stdout) == (run == 1 and CPUEngineSettings().prefetch_bytes != 0)
    files = list(where.glob("*.gguf"))
    assert len(files) == 1 and not list(where.glob("*.part"))
    per_expert = 3 * h * i // 32 * 34  # Q8_0: 34 bytes per 32 values, three matrices of H x I
    res = json.loads(out.read_text())
    assert res["prefetch_bytes_default"] == CPUEngineSettings().prefetch_bytes  # what issue_tables.py keeps
    grid = [(q, n, d) for q in (1, 0) for n in (8, 2) for d in (4096, 0)]
    assert [(r["block_prefetch"], r["items_per_thread"], r["prefetch_bytes"]) for r in res["runs"]] == grid
    assert sorted((e["block_prefetch"], e["items_per_thread"], e["prefetch_bytes"]) for e in res["summary"]) == sorted(grid)
    row = res["runs"][0]
    assert row["tokens_per_s"] > 0 and row["cpu_tasks_per_step"] > 0
    assert row["cpu_expert_bytes_per_token"] == pytest.approx(layers * k * (e - gpu) / e * per_expert)


def test_gguf_experts_file_reads_back(tmp_path):
    """gguf_experts_file.write_experts_gguf: llama.cpp's names and torch-order shapes, the given block
    count, only the MoE layers, and each tensor's blocks valid for the CPU kernels' reader."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gguf_experts_file import write_experts_gguf

    from hybridmoe.gguf.experts import layer_experts
    from hybridmoe.gguf.reader import GGUFModel

    path = write_experts_gguf(tmp_path / "x.gguf", "Q4_K", 3, [1, 2], 4, 256, 512, log=None)
    m = GGUFModel.open(str(path))
    assert m.meta("qwen3moe.block_count") == 3
    assert sorted(n for n in m.tensors) == sorted(f"blk.{layer}.ffn_{p}_exps.weight" for layer in (1, 2)
                                                  for p in ("gate", "up", "down"))
    assert m.tensor("blk.1.ffn_down_exps.weight").shape == (4, 256, 512)
    assert layer_experts(m, 2, 4, 256, 512).num_experts == 4
    with pytest.raises(ValueError, match="multiple of 256"):
        write_experts_gguf(tmp_path / "y.gguf", "Q4_K", 1, [0], 4, 256, 96, log=None)


# ---- --dummy-deepseek-v3 / --dummy-kimi-k2 (benchmarks/shapes.py) ------------------------------------
SHAPE_SCRIPTS = ["bench_cpu_moe.py", "bench_decode.py", "bench_hybrid_decode.py", "bench_hybrid_prefill.py",
                 "profile_decode.py"]


def _shapes():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import shapes

    return shapes


def test_dummy_shapes_are_the_published_configs():
    """The benchmark shapes equal the published configs kept as test fixtures, key by key (the
    fixtures also carry auto_map and version fields the benchmarks do not need)."""
    shapes = _shapes()
    for name, fixture in (("deepseek-v3", "deepseek_v3"), ("kimi-k2", "kimi_k2")):
        published = json.loads((REPO / "tests" / "fixtures" / "configs" / f"{fixture}.json").read_text())
        cfg = shapes.dummy_config(name)
        for key, value in cfg.items():
            assert published[key] == value, (name, key, value, published[key])
        assert not {"num_hidden_layers", "n_routed_experts", "kv_lora_rank", "q_lora_rank", "n_group", "topk_group",
                    "first_k_dense_replace", "n_shared_experts", "rope_scaling", "quantization_config",
                    "routed_scaling_factor", "topk_method", "scoring_func", "moe_intermediate_size"} - set(cfg)
    flags = shapes.shape_flags(shapes.dummy_config("deepseek-v3"))
    assert (flags["E"], flags["k"], flags["H"], flags["I"], flags["layers"]) == (256, 8, 7168, 2048, 61)
    assert shapes.shape_flags(shapes.dummy_config("kimi-k2"))["E"] == 384


@pytest.mark.parametrize("name,layers,dense", [("deepseek-v3", 61, 3), ("deepseek-v3", 5, 3), ("deepseek-v3", 3, 2),
                                               ("deepseek-v3", 1, 0), ("kimi-k2", 4, 1), ("kimi-k2", 1, 0)])
def test_layers_cut_the_depth_keeping_a_moe_layer(name, layers, dense):
    shapes = _shapes()
    cfg = shapes.dummy_config(name, layers)
    assert cfg["num_hidden_layers"] == layers and cfg["first_k_dense_replace"] == dense
    assert shapes.DUMMY_MODELS[name]["num_hidden_layers"] == 61  # the table itself is not changed
    assert "quantization_config" not in shapes.dummy_config(name, layers, fp8=False)
    with pytest.raises(ValueError, match="--layers 0"):
        shapes.dummy_config(name, 0)


def test_apply_dummy_shape_sets_the_scripts_flags():
    import argparse

    shapes = _shapes()
    a = argparse.Namespace(dummy_model="kimi-k2", dummy_bf16=False, layers=4, experts=128, topk=8, hidden=2048,
                           inter=768, heads=32, kv_heads=4, head_dim=128, vocab=151936)
    cfg = shapes.apply_dummy_shape(a, 48)
    assert a.dummy_config is cfg and cfg["num_hidden_layers"] == 4
    assert (a.layers, a.experts, a.hidden, a.inter, a.heads, a.vocab) == (4, 384, 7168, 2048, 64, 163840)
    plain = argparse.Namespace(dummy_model=None, layers=None, experts=128)
    assert shapes.apply_dummy_shape(plain, 48) is None and plain.layers == 48 and plain.experts == 128


def test_written_dummy_config_loads_and_plans(tmp_path):
    """bench_decode.write_config of --dummy-deepseek-v3 --layers 5 loads through hybridmoe's config
    path, passes the startup checks, and its memory plan has 2 MoE layers of 256 fp8 experts."""
    import argparse

    sys.path.insert(0, str(REPO / "tests"))
    from hybridmoe.model_check import check_config
    from hybridmoe.moe.memory_plan import plan_memory
    from hybridmoe.moe.placement import place_experts
    from hybridmoe.weights.loader import load_hf_config

    from deepseek_fixtures import spec_for

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_decode import write_config

    a = argparse.Namespace(dummy_model="deepseek-v3", dummy_bf16=False, layers=5)
    _shapes().apply_dummy_shape(a, 48)
    write_config(tmp_path, a)
    cfg = load_hf_config(str(tmp_path))
    spec = spec_for(cfg)
    check_config(cfg, spec, json.loads((tmp_path / "config.json").read_text()), tmp_path / "config.json")
    assert spec.moe_layers == (3, 4) and spec.num_experts == 256
    masks = place_experts("uniform", list(spec.moe_layers), 256, 32)
    plan = plan_memory(cfg, spec, masks, 2, "AMXINT8", 1024, 1)
    assert plan.gpu["GPU experts"] == 2 * 32 * plan.gpu_expert_bytes
    assert plan.gpu_expert_bytes == 3 * 7168 * 2048 + 4 * 3 * 16 * 56  # fp8 + a float32 scale per 128x128 block


@pytest.mark.parametrize("script", SHAPE_SCRIPTS)
def test_scripts_list_the_dummy_flags(script):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--dummy-deepseek-v3", "--dummy-kimi-k2", "--dummy-bf16", "--layers"):
        assert flag in proc.stdout, (script, flag)
