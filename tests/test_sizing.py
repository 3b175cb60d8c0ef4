"""Sizing: the --kt-method recommendation and its reason, the largest --kt-num-gpu-experts that fits,
`hybridmoe check --model`, and `--kt-num-gpu-experts auto`."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridmoe.bench.shapes import write_shape_dir
from hybridmoe.check import check_main
from hybridmoe.model_check import load_checked_config
from hybridmoe.moe.memory_plan import plan_memory
from hybridmoe.moe.placement import place_experts
from hybridmoe.sizing import GiB, recommend_method, size_gpu_experts

NONE = {"AMX int8": False, "AVX-512 VNNI": False, "AVX2": False}


@pytest.mark.parametrize("isa,method,why", [
    ({**NONE, "AMX int8": True, "AVX-512 VNNI": True, "AVX2": True}, "AMXINT8", "AMX int8 tiles present"),
    ({**NONE, "AVX-512 VNNI": True, "AVX2": True}, "AMXINT8", "AVX-512 VNNI"),
    ({**NONE, "AVX2": True}, "AMXINT8", "AVX2 only"),
    (NONE, "BF16", "no AVX2"),
])
def test_method_and_reason_by_isa(isa, method, why):
    m, reason = recommend_method(isa)
    assert m == method and why in reason


def test_fp8_checkpoint_gets_fp8():
    cfg = argparse.Namespace(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert recommend_method({**NONE, "AVX2": True}, cfg)[0] == "FP8"


@pytest.fixture(scope="module")
def q30(tmp_path_factory):
    d = write_shape_dir("qwen3-30b-a3b", tmp_path_factory.mktemp("q30"))
    return d, *load_checked_config(str(d))


@pytest.mark.parametrize("gib,ctx", [(24, 32768), (40, 8192), (16, 4096)])
def test_largest_that_fits(q30, gib, ctx):
    _, cfg, spec = q30
    s = size_gpu_experts(cfg, spec, int(gib * GiB), context_len=ctx)
    budget = int(gib * GiB * 0.85)

    def total(n):
        masks = place_experts("uniform", list(spec.moe_layers), spec.num_experts, n)
        return sum(plan_memory(cfg, spec, masks, 2, "AMXINT8", ctx, 256, prefill_tokens=min(8192, ctx)).gpu.values())

    assert 0 < s.num_gpu_experts < spec.num_experts
    assert total(s.num_gpu_experts) <= budget < total(s.num_gpu_experts + 1)


def test_everything_fits_a_big_gpu_and_nothing_without_one(q30):
    _, cfg, spec = q30
    assert size_gpu_experts(cfg, spec, 140 * GiB, context_len=4096).num_gpu_experts == 128
    s = size_gpu_experts(cfg, spec, None)
    assert s.num_gpu_experts == 0 and "no CUDA GPU" in s.lines[0]
    tiny = size_gpu_experts(cfg, spec, 2 * GiB, context_len=4096)
    assert tiny.num_gpu_experts == 0 and "even with no GPU experts" in tiny.lines[0]


def test_check_model_command_line(q30, capsys):
    d = q30[0]
    assert check_main(["--model", str(d), "--gpu-memory-gib", "24", "--context-length", "32768"]) == 0
    out = capsys.readouterr().out
    cmd = next(x for x in out.splitlines() if x.startswith("command"))
    assert f"hybridmoe serve --model-path {d} --kt-method" in cmd and "--context-length 32768" in cmd
    assert "--kt-cpuinfer" in cmd and "--kt-threadpool-count" in cmd
    assert check_main(["--json", "--model", str(d), "--gpu-memory-gib", "24", "--context-length", "32768"]) == 0
    r = json.loads(capsys.readouterr().out)
    n = r["sizing"]["num_gpu_experts"]
    assert f"--kt-num-gpu-experts {n}" in cmd and r["recommended_flags"]["--kt-num-gpu-experts"] == n


def test_check_model_demo_here(capsys):
    import torch

    assert check_main(["--model", "hybridmoe/demo_model"]) == 0
    out = capsys.readouterr().out
    assert "why" in out and "command        hybridmoe serve --model-path hybridmoe/demo_model" in out
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in out and "--kt-num-gpu-experts 0" in out


def test_check_model_bad_dir(tmp_path, capsys):
    assert check_main(["--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_auto_on_cpu_is_zero(caplog):
    from hybridmoe.args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    caplog.set_level("INFO")
    args = engine_args_from(p.parse_args(["--device", "cpu", "--kt-num-gpu-experts", "auto"]))
    assert args.kt_num_gpu_experts == 0
    assert any("--kt-num-gpu-experts auto: using 0" in r.getMessage() for r in caplog.records)
    assert engine_args_from(p.parse_args(["--kt-num-gpu-experts", "3"])).kt_num_gpu_experts == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--kt-num-gpu-experts", "many"])


def test_auto_with_a_ratio_is_not_sized(caplog):
    """--kt-gpu-experts-ratio sets the count (it wins over a count): auto then sizes nothing, and says so in one
    line (it logged a sized count that placement then overrode with a warning)."""
    from hybridmoe.args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    caplog.set_level("INFO")
    args = engine_args_from(p.parse_args(["--device", "cpu", "--kt-num-gpu-experts", "auto",
                                          "--kt-gpu-experts-ratio", "0.25"]))
    assert args.kt_num_gpu_experts is None and args.kt_gpu_experts_ratio == 0.25
    msgs = [r.getMessage() for r in caplog.records]
    assert any("--kt-gpu-experts-ratio 0.25 sets the GPU experts" in m for m in msgs)
    assert not any("auto: using" in m for m in msgs)


@pytest.mark.gpu
def test_auto_on_the_gpu_fits(q30):
    """On a GPU: auto picks the largest count that fits this GPU for the shape."""
    import torch

    _, cfg, spec = q30
    total = torch.cuda.get_device_properties(0).total_memory
    s = size_gpu_experts(cfg, spec, total, context_len=8192)
    assert s.num_gpu_experts >= 1 and s.plan_gib * GiB <= total * 0.85
