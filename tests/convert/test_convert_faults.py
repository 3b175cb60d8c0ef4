"""`hybridmoe convert` under faults: SIGKILL then --resume (byte-identical), corrupted files caught at
load and by --verify, and a clear message for each bad input, option or mismatch."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.cli import main as cli_main
from hybridmoe.convert import DELAY_ENV
from hybridmoe.weights import cpu_format as cf
from hybridmoe.weights.cpu_format import CPUWeightsError

from convert_helpers import dir_bytes, run_convert


def _load(src: Path, out: Path, method: str = "AMXINT8") -> LLM:
    return LLM(str(src), device="cpu", progress=False, kt_num_gpu_experts=0, kt_method=method,
               kt_weight_path=str(out))


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) - 100 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_sigkill_then_resume_is_byte_identical(bf16_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hybridmoe.convert")
    src = bf16_checkpoint("mixtral", num_hidden_layers=5)  # 5 MoE layers
    assert run_convert(src, tmp_path / "whole", "int4") == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "hybridmoe.convert", "--input-path", str(src), "--output", str(out),
           "--quant-method", "int4", "--no-progress"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, **{DELAY_ENV: "1.0"}), stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:  # kill once two layers are recorded
        prog = out / "progress.json"
        if prog.is_file() and len(json.loads(prog.read_text())["files"]) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists() and len(list(out.glob("layer_*.safetensors"))) < 5
    finished = len(json.loads((out / "progress.json").read_text())["files"])
    assert finished >= 2
    with pytest.raises(CPUWeightsError, match="unfinished conversion.*--resume"):  # never loads as complete
        _load(src, out, "AMXINT4")
    assert run_convert(src, out, "int4") == 2  # without --resume: refused, the partial work kept
    _flip(out / "layer_0000.safetensors")  # a finished layer damaged meanwhile is found and redone
    assert run_convert(src, out, "int4", "--resume") == 0
    assert "layer_0000.safetensors: missing or corrupted; converting layer 0 again" in caplog.text
    assert f"converted {5 - finished + 1} layer(s)" in caplog.text  # the verified ones are kept
    assert dir_bytes(out) == dir_bytes(tmp_path / "whole")
    assert run_convert(src, out, "int4", "--resume") == 0  # resuming a complete directory: verified, unchanged
    assert dir_bytes(out) == dir_bytes(tmp_path / "whole")


def test_flipped_byte_is_detected_at_load_and_by_verify(converted, tmp_path, capsys):
    src, good = converted
    out = tmp_path / "bad"
    shutil.copytree(good, out)
    assert cli_main(["convert", "--verify", str(out)]) == 0
    _flip(out / "layer_0002.safetensors")
    assert cli_main(["convert", "--verify", str(out)]) == 1
    assert "layer_0002.safetensors: checksum mismatch" in capsys.readouterr().err
    with pytest.raises(CPUWeightsError, match=r"layer_0002\.safetensors: checksum mismatch.*--resume"):
        _load(src, out)
    assert run_convert(src, out, "int8", "--resume") == 0  # re-verifies, redoes only the bad layer
    assert dir_bytes(out) == dir_bytes(good)
    with open(out / "layer_0000.safetensors", "r+b") as f:  # truncated
        f.truncate(1000)
    with pytest.raises(CPUWeightsError, match=r"layer_0000\.safetensors: 1000 bytes, the manifest says"):
        _load(src, out)


def test_load_checks_method_model_and_source(converted, bf16_checkpoint, tmp_path):
    src, out = converted
    with pytest.raises(CPUWeightsError, match="weights are AMXINT8.*pass --kt-method AMXINT8"):
        _load(src, out, "AMXINT4")
    with pytest.raises(CPUWeightsError, match="converted for another model: num_experts 10 \\(model 6\\)"):
        _load(bf16_checkpoint("mixtral"), out)
    other = tmp_path / "other"  # same shapes, another checkpoint's config
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, rms_norm_eps=1e-5)))
    with pytest.raises(CPUWeightsError, match="different checkpoint.*differs in rms_norm_eps"):
        _load(other, out)
    with pytest.raises(CPUWeightsError, match="no manifest.json"):
        _load(src, tmp_path)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("method", "", "damaged (field 'method' is '', expected one of"),
    ("activation", "FP8", "damaged (field 'activation' is 'FP8', expected one of"),
])
def test_manifest_names_a_method_and_activation_the_kernels_have(converted, tmp_path, field, value, words):
    """A manifest edited to an unknown method or activation is damaged (before: an empty method gave 'the
    weights are  (...) pass --kt-method ', an unknown activation a ValueError naming no file)."""
    src, out = converted
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(dict(m, **{field: value})))
    with pytest.raises(CPUWeightsError, match=re.escape(f"{bad / 'manifest.json'}: {words}")):
        _load(src, bad)


def _error(capsys, src: Path, out: Path, *extra: str, input_type: str = "bf16", method: str = "int8") -> str:
    assert run_convert(src, out, method, *extra, input_type=input_type) == 2
    return capsys.readouterr().err


def test_bad_inputs_are_clear_errors(bf16_checkpoint, tmp_path, capsys):
    src = bf16_checkpoint("qwen3_moe")
    err = _error(capsys, tmp_path / "nowhere", tmp_path / "o1")
    assert "--input-path" in err and "nowhere: no such directory" in err
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.7.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    err = _error(capsys, broken, tmp_path / "o2")
    assert "'model.layers.2.mlp.experts.7.down_proj.weight' is missing" in err
    with open(broken / "model.safetensors", "r+b") as f:  # truncated shard
        f.truncate(os.path.getsize(broken / "model.safetensors") // 2)
    err = _error(capsys, broken, tmp_path / "o3")
    assert "model.safetensors: tensor 'model.layers." in err and "the file is truncated" in err
    cfg = json.loads((src / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"])))
    assert "architecture ['LlamaForCausalLM'] is not supported" in _error(capsys, broken, tmp_path / "o4")
    err = _error(capsys, src, tmp_path / "o5", input_type="fp16")
    assert "is torch.bfloat16, but --input-type is fp16" in err
    err = _error(capsys, src, tmp_path / "o6", input_type="fp8")
    assert "quantization_config.weight_block_size" in err
    assert "int4 groups must be one of" in _error(capsys, src, tmp_path / "o7", "--group-size", "48", method="int4")


def test_existing_output_is_not_overwritten(converted, capsys):
    src, out = converted
    assert "already holds a complete conversion" in _error(capsys, src, out)
    assert "other settings" in _error(capsys, src, out, "--resume", method="int4")


def test_disk_full(bf16_checkpoint, tmp_path, monkeypatch, capsys):
    src = bf16_checkpoint("qwen3_moe")
    monkeypatch.setattr("hybridmoe.convert.shutil.disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1000))
    err = _error(capsys, src, tmp_path / "o")
    assert "1000 B free on that disk" in err and "need" in err and "need 0.00" not in err
    monkeypatch.undo()
    real = cf._raw_bytes
    calls = []

    def full(t):  # the disk fills up while the second layer file is written
        calls.append(1)
        if len(calls) > 6:  # int8: 6 tensors per layer file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(t)

    monkeypatch.setattr(cf, "_raw_bytes", full)
    err = _error(capsys, src, tmp_path / "o")
    assert "layer_0002.safetensors: disk full while writing it" in err and "--resume" in err
    assert not list((tmp_path / "o").glob("*.tmp"))
    monkeypatch.undo()
    assert run_convert(src, tmp_path / "o", "int8", "--resume") == 0
    assert cli_main(["convert", "--verify", str(tmp_path / "o")]) == 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_non_finite_weights_are_named(bf16_checkpoint, tmp_path, capsys, method):
    """A NaN in an expert tensor of the source (a damaged download) stops the conversion with one line
    naming the tensor and row, instead of converting it to plausible-looking garbage."""
    broken = tmp_path / "nan"
    shutil.copytree(bf16_checkpoint("qwen3_moe"), broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.2.mlp.experts.6.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][5, 3] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    err = _error(capsys, broken, tmp_path / "out", method=method)
    assert f"tensor '{name}': row 5 holds NaN or infinite values: the checkpoint is damaged" in err
    assert "Traceback" not in err and sum(ln.startswith("hybridmoe convert: error:") for ln in err.splitlines()) == 1
