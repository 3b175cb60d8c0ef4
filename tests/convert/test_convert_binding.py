"""Converted CPU weights are bound to their checkpoint (an expert fingerprint, not only config.json),
the output directory is locked against a second writer, and a damaged manifest says so."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.cli import main as cli_main
from hybridmoe.convert import DELAY_ENV
from hybridmoe.model_check import load_checked_config
from hybridmoe.weights import cpu_format as cf
from hybridmoe.weights.cpu_format import CPUWeightDir, CPUWeightsError
from hybridmoe.weights.dir_lock import LOCK_NAME, DirLock
from hybridmoe.weights.fingerprint import SCHEME, expert_fingerprint

from convert_helpers import run_convert


def _fine_tune(src: Path, dst: Path, only: str | None = None, scale: float = 0.05) -> Path:
    """A copy of `src` whose expert weights (or only tensor `only`) moved a little, config.json unchanged."""
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    for name in t:
        if ".experts." in name and (only is None or name == only):
            t[name] = (t[name].float() + scale * torch.randn(t[name].shape)).to(t[name].dtype)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _check(model: Path, out: Path) -> None:
    config, spec = load_checked_config(str(model))
    CPUWeightDir(out).check_model(config, str(model), "AMXINT8", spec)


def test_weights_of_a_fine_tune_are_refused_naming_both(converted, tmp_path, capsys, monkeypatch):
    src, out = converted
    monkeypatch.setattr("hybridmoe.server.run.run_server", lambda *a, **k: pytest.fail("the server started"))
    _check(src, out)  # its own checkpoint: accepted
    assert json.loads((out / cf.MANIFEST).read_text())["source_path"] == str(src.resolve())
    ft = _fine_tune(src, tmp_path / "ft")
    assert (ft / "config.json").read_bytes() == (src / "config.json").read_bytes()
    with pytest.raises(CPUWeightsError) as e:
        _check(ft, out)
    msg = str(e.value)
    assert f"--kt-weight-path {out} holds experts converted from {src.resolve()}, not from --model {ft}" in msg
    assert "expert weights differ" in msg
    # one changed expert tensor is enough: every tensor is sampled
    one = _fine_tune(src, tmp_path / "one", only="model.layers.2.mlp.experts.7.down_proj.weight")
    with pytest.raises(CPUWeightsError, match="expert weights differ"):
        _check(one, out)
    # the command lines: one line, exit code 2, before loading anything
    for cmd in (["generate", "--max-new-tokens", "1"], ["serve", "--port", "0"]):
        argv = [cmd[0], "--device", "cpu", "--model-path", str(ft), "--kt-weight-path", str(out),
                "--kt-num-gpu-experts", "0", "--kt-method", "AMXINT8", *cmd[1:]]
        assert cli_main(argv) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and f"not from --model {ft}" in lines[0] and str(out) in lines[0]


def test_fingerprint_is_of_values_not_storage(bf16_checkpoint, tmp_path):
    """A bf16 copy of an fp32 checkpoint has the original's fingerprint; other experts do not."""
    src = bf16_checkpoint("mixtral")  # its fp32 original is the sibling directory f32
    config, spec = load_checked_config(str(src))
    fp = expert_fingerprint(src, spec, config)
    assert fp.startswith(SCHEME + ":")
    assert expert_fingerprint(src.parent / "f32", spec, config) == fp
    assert expert_fingerprint(_fine_tune(src, tmp_path / "ft", scale=0.01), spec, config) != fp


def test_directory_of_an_older_version_loads_with_a_warning(converted, tmp_path, caplog):
    src, good = converted
    old = tmp_path / "old"
    shutil.copytree(good, old)
    m = json.loads((old / cf.MANIFEST).read_text())
    del m["source_experts_fingerprint"], m["source_path"]  # as version 0.1 wrote it
    (old / cf.MANIFEST).write_text(json.dumps(m))
    _check(src, old)
    assert "converted by an older hybridmoe, without an expert fingerprint" in caplog.text
    m["source_experts_fingerprint"] = "sha3-everything-v9:00"
    (old / cf.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CPUWeightsError, match="fingerprint scheme 'sha3-everything-v9' is unknown"):
        _check(src, old)


def test_a_second_writer_is_refused(bf16_checkpoint, tmp_path, capsys, caplog):
    src = bf16_checkpoint("mixtral", num_hidden_layers=3)
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()  # the fixture's model building
    with DirLock(out, "test holder"):  # held in this process: flock conflicts between open files too
        assert run_convert(src, out, "int4") == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"{out / LOCK_NAME}: held by test holder (pid {os.getpid()}" in err[0]
    assert not (out / LOCK_NAME).exists()  # released and removed
    cmd = [sys.executable, "-m", "hybridmoe.convert", "--input-path", str(src), "--output", str(out),
           "--quant-method", "int4", "--no-progress"]
    env = dict(os.environ, **{DELAY_ENV: "1.5"}, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (out / cf.PROGRESS).is_file():
        time.sleep(0.05)
    for extra in (["--resume"], []):  # a second writer, --resume included
        assert run_convert(src, out, "int4", *extra) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"{out / LOCK_NAME}: held by hybridmoe convert (pid {proc.pid}" in err[0]
        assert "wait for it to finish or stop it" in err[0]
    proc.send_signal(signal.SIGKILL)  # dies holding the lock: the next writer takes it over
    proc.wait()
    assert (out / LOCK_NAME).is_file()
    caplog.set_level(logging.WARNING)
    assert run_convert(src, out, "int4", "--resume") == 0
    assert f"taking over the lock left by pid {proc.pid} (no longer running)" in caplog.text
    assert not (out / LOCK_NAME).exists()
    assert cli_main(["convert", "--verify", str(out)]) == 0


DAMAGE = {
    "not_json": lambda text: text[: len(text) // 2],
    "a_list": lambda text: "[1, 2]",
    "no_files": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "files"}),
    "entry_without_sha": lambda text: json.dumps(dict(json.loads(text), files={
        k: {"layer": v["layer"], "bytes": v["bytes"]} for k, v in json.loads(text)["files"].items()})),
    "layer_as_text": lambda text: json.dumps(dict(json.loads(text), files={
        k: dict(v, layer=str(v["layer"])) for k, v in json.loads(text)["files"].items()})),
    "hidden_as_text": lambda text: json.dumps(dict(json.loads(text), hidden="72")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_manifest_is_reported_as_damaged(damage, converted, tmp_path, capsys):
    src, good = converted
    out = tmp_path / "d"
    shutil.copytree(good, out)
    path = out / cf.MANIFEST
    path.write_text(DAMAGE[damage](path.read_text()))
    assert run_convert(src, out, "int8", "--resume") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{path}: damaged (" in err[0] and f"remove {out} and convert again" in err[0], err
    assert cli_main(["convert", "--verify", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{path}: damaged (" in err[0], err
    with pytest.raises(CPUWeightsError, match="damaged .*convert the checkpoint again into a new directory"):
        CPUWeightDir(out)


def test_damaged_progress_is_reported_as_damaged(converted, tmp_path, capsys):
    src, good = converted
    out = tmp_path / "p"
    shutil.copytree(good, out)
    (out / cf.MANIFEST).rename(out / cf.PROGRESS)  # an unfinished conversion
    (out / cf.PROGRESS).write_text('{"format": "hybridmoe-cpu-experts", "format_version": 1, "files": 3}')
    assert run_convert(src, out, "int8", "--resume") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{out / cf.PROGRESS}: damaged (field 'method' is missing)" in err[0], err
