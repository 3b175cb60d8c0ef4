"""`hybridmoe convert` round trips: converted weights loaded with --kt-weight-path give exactly the
logits of quantizing at load time (same bits), for each method, on Qwen3-MoE and Mixtral, from
bf16, fp16 and block-scaled fp8 checkpoints; also through a hybrid split and the HTTP server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.convert import QUANT_METHODS
from hybridmoe.cpu.quant import pack_layer
from hybridmoe.weights.cpu_format import CPUWeightDir
from hybridmoe.weights.fp8 import block_quant

from convert_helpers import dir_bytes, run_convert
from tiny_models import hf_model, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "hybridmoe" / "demo_model"
PROMPT = torch.randint(0, 199, (24,), generator=torch.Generator().manual_seed(5)).tolist()


def _llm(path: Path, method: str, **kw) -> LLM:
    return LLM(str(path), device="cpu", progress=False, kt_num_gpu_experts=0, kt_method=method, **kw)


def _packed(llm: LLM) -> list[dict[str, torch.Tensor]]:
    return [b.experts.layer.packed.tensors() for b in llm.engine.runner.model.moe_blocks()]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("quant", ["int8", "int4", "bf16", "moe_int8", "moe_int4"])
def test_round_trip_equals_load_time_quantization(bf16_checkpoint, tmp_path, kind, quant):
    src, method = bf16_checkpoint(kind), QUANT_METHODS[quant]
    assert run_convert(src, tmp_path / "cpu", quant) == 0
    assert not (tmp_path / "cpu" / "progress.json").exists()
    at_load = _llm(src, method)
    converted = _llm(src, method, kt_weight_path=str(tmp_path / "cpu"))
    assert converted.engine.runner.moe.kt_weights is not None  # read from the directory, not quantized
    for a, b in zip(_packed(at_load), _packed(converted), strict=True):  # the same bits ...
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(converted.prompt_logits(PROMPT), at_load.prompt_logits(PROMPT))  # ... the same logits
    f = next((tmp_path / "cpu").glob("layer_*.safetensors"))
    with safe_open(str(f), "pt") as h:  # standard safetensors, readable by other tools
        assert set(h.keys()) == set(_packed(converted)[0]) and json.loads(h.metadata()["meta"])["method"] == method


def test_fp16_checkpoint(tmp_path):
    hf_model(make_tiny_model("mixtral", tmp_path / "f32")).to(torch.float16).save_pretrained(str(tmp_path / "h"))
    assert run_convert(tmp_path / "h", tmp_path / "cpu", "int8", input_type="fp16") == 0
    ref = _llm(tmp_path / "h", "AMXINT8").prompt_logits(PROMPT)
    assert torch.equal(_llm(tmp_path / "h", "AMXINT8", kt_weight_path=str(tmp_path / "cpu")).prompt_logits(PROMPT), ref)


def _expand(scale: torch.Tensor, n: int, k: int, b: int) -> torch.Tensor:
    return scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]


def _fp8_checkpoints(src: Path, root: Path, block: int = 32) -> tuple[Path, Path]:
    """(fp8 checkpoint: experts float8_e4m3fn + weight_scale_inv in block x block, DeepSeek-V3 style;
    reference: the same with every expert dequantized to float32, no quantization_config)."""
    fp8, ref = root / "fp8", root / "ref"
    tensors = load_file(str(src / "model.safetensors"))
    q_t, r_t = {}, {}
    for name, w in tensors.items():
        if ".experts." in name:
            q, s = block_quant(w.float(), (block, block))
            q_t[name], q_t[name + "_scale_inv"] = q, s
            r_t[name] = q.float() * _expand(s, *w.shape, block)  # the dequantized reference, computed here
        else:
            q_t[name] = r_t[name] = w
    cfg = json.loads((src / "config.json").read_text())
    for d, t, c in ((fp8, q_t, dict(cfg, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                     "activation_scheme": "dynamic", "weight_block_size": [block, block]})), (ref, r_t, cfg)):
        d.mkdir()
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(c))
    return fp8, ref


@pytest.mark.parametrize("quant", ["int8", "bf16"])
def test_fp8_checkpoint_matches_the_dequantized_reference(bf16_checkpoint, tmp_path, quant):
    fp8, ref = _fp8_checkpoints(bf16_checkpoint("qwen3_moe"), tmp_path)  # H=72, I=40: partial 32x32 blocks
    with safe_open(str(fp8 / "model.safetensors"), "pt") as h:
        assert h.get_tensor("model.layers.0.mlp.experts.0.up_proj.weight").dtype == torch.float8_e4m3fn
    method = QUANT_METHODS[quant]
    assert run_convert(fp8, tmp_path / "cpu", quant, input_type="fp8") == 0
    d = CPUWeightDir(tmp_path / "cpu")
    r = load_file(str(ref / "model.safetensors"))
    for layer in d.manifest["moe_layers"]:
        e = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([torch.cat([r[f"{e}.{j}.gate_proj.weight"], r[f"{e}.{j}.up_proj.weight"]]) for j in
                               range(10)])
        down = torch.stack([r[f"{e}.{j}.down_proj.weight"] for j in range(10)])
        want = pack_layer(gate_up, down, method).tensors()
        got = d.load_layer(layer).tensors()
        assert all(torch.equal(got[k], want[k]) for k in want)
    # the reference checkpoint (same config but quantization_config) serves the converted fp8 experts
    at_load = _llm(ref, method).prompt_logits(PROMPT)
    assert torch.equal(_llm(ref, method, kt_weight_path=str(tmp_path / "cpu")).prompt_logits(PROMPT), at_load)


def test_hybrid_split_takes_the_cpu_experts_from_the_directory(bf16_checkpoint, tmp_path):
    src = bf16_checkpoint("qwen3_moe")
    assert run_convert(src, tmp_path / "cpu", "int8") == 0
    kw = dict(device="cpu", progress=False, kt_num_gpu_experts=4, kt_method="AMXINT8")
    at_load = LLM(str(src), **kw).prompt_logits(PROMPT)
    assert torch.equal(LLM(str(src), kt_weight_path=str(tmp_path / "cpu"), **kw).prompt_logits(PROMPT), at_load)


def test_serve_with_kt_weight_path(tmp_path):
    """`hybridmoe serve --kt-weight-path`: the demo model's experts converted to int4 serve the
    greedy tokens of quantizing at load."""
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    out = tmp_path / "cpu"
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "convert", "--input-path", str(DEMO), "--output",
                        str(out), "--quant-method", "int4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--kt-weight-path" in r.stdout and "Converting" in r.stderr  # the hint and the progress bar
    with socket_port() as port:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "hybridmoe.launch_server", "--device", "cpu", "--port", str(port),
               "--kt-weight-path", str(out), "--kt-method", "AMXINT4"]
        with open(tmp_path / "log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 90
            while time.time() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert proc.poll() is None, (tmp_path / "log").read_text()
            body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                   "ignore_eos": True}}
            got = httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"]
        finally:
            proc.terminate()
            proc.wait(30)
    want = LLM(str(DEMO), device="cpu", progress=False, kt_num_gpu_experts=0, kt_method="AMXINT4").generate(
        input_ids=[5, 6, 7, 8], sampling_params=body["sampling_params"])["output_ids"]
    assert got == want


class socket_port:
    """A free local TCP port (as a context manager, for readability)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        return None


def test_chunks_of_experts_do_not_change_the_output(bf16_checkpoint, tmp_path, monkeypatch):
    """Experts are read, packed and written in chunks (3 of the 10 here: 3, 3, 3, 1); the files are
    those of one chunk per layer."""
    src = bf16_checkpoint("qwen3_moe")
    assert run_convert(src, tmp_path / "whole", "int4") == 0
    monkeypatch.setattr("hybridmoe.convert.CHUNK_BYTES", 3 * (3 * 40 * 72 * 4))
    assert run_convert(src, tmp_path / "chunked", "int4") == 0
    assert dir_bytes(tmp_path / "chunked") == dir_bytes(tmp_path / "whole")


def test_int4_group_size(bf16_checkpoint, tmp_path):
    """--group-size 32 (load-time quantization always uses 128): the files hold pack_layer's groups of 32,
    which serve logits closer to the unquantized model's than groups of 128 do."""
    src = bf16_checkpoint("mixtral")
    assert run_convert(src, tmp_path / "cpu", "int4", "--group-size", "32") == 0
    r = load_file(str(src / "model.safetensors"))
    e = "model.layers.1.block_sparse_moe.experts"
    gate_up = torch.stack([torch.cat([r[f"{e}.{j}.w1.weight"], r[f"{e}.{j}.w3.weight"]]) for j in range(6)])
    down = torch.stack([r[f"{e}.{j}.w2.weight"] for j in range(6)])
    want = pack_layer(gate_up, down, "AMXINT4", group_size=32).tensors()
    got = CPUWeightDir(tmp_path / "cpu").load_layer(1).tensors()
    assert all(torch.equal(got[k], want[k]) for k in want)
    ours = _llm(src, "AMXINT4", kt_weight_path=str(tmp_path / "cpu")).prompt_logits(PROMPT)
    g128 = _llm(src, "AMXINT4").prompt_logits(PROMPT)
    exact = LLM(str(src), device="cpu", progress=False).prompt_logits(PROMPT)
    assert (ours - exact).norm() < (g128 - exact).norm()
