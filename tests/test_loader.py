"""Checkpoint loading: sharded files, dtypes, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.config import ConfigError
from hybridmoe.weights.loader import CheckpointError

from tiny_models import hf_model, make_tiny_model

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_sharded_checkpoint_with_index(tmp_path):
    path = make_tiny_model("mixtral", tmp_path / "m")
    model = hf_model(path)
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    a = LLM(str(path), device="cpu", progress=False).generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    b = LLM(str(tmp_path / "sharded"), device="cpu", progress=False).generate(input_ids=[1, 2, 3],
                                                                             sampling_params=GREEDY)
    assert a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(tmp_path, dtype):
    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    hf_model(path).to(dtype).save_pretrained(str(tmp_path / "h"))
    logits = LLM(str(tmp_path / "h"), device="cpu", progress=False).prompt_logits([5, 6, 7])
    assert logits.shape == (3, 211) and torch.isfinite(logits).all()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(tmp_path):
    path = _copy(make_tiny_model("qwen3_moe", tmp_path / "m"), tmp_path / "broken")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight.*missing"):
        LLM(str(path), device="cpu", progress=False)


def test_wrong_shape_is_named(tmp_path):
    path = _copy(make_tiny_model("qwen3_moe", tmp_path / "m"), tmp_path / "broken")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(5, 5)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*shape \(5, 5\), expected \(96, 72\)"):
        LLM(str(path), device="cpu", progress=False)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = _copy(make_tiny_model("qwen3_moe", tmp_path / "m"), tmp_path / "other")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM") as e:
        LLM(str(path), device="cpu", progress=False)
    assert "MixtralForCausalLM" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_missing_directory_and_bad_option(tmp_path):
    with pytest.raises(CheckpointError, match="nothing: no such directory"):  # the startup checks' line (as serve's)
        LLM(str(tmp_path / "nothing"), device="cpu", progress=False)
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(str(tmp_path), device="cpu", progress=False)
    with pytest.raises(ConfigError, match="unknown option"):
        LLM(str(tmp_path), device="cpu", progress=False, kt_num_gpu_expert=3)
    with pytest.raises(ConfigError, match="--kt-method"):
        LLM(str(tmp_path), device="cpu", progress=False, kt_method="INT3")


def test_generation_config_warnings_stay_quiet(tmp_path):
    """Only the eos ids of generation_config.json are read: transformers' warnings about its sampling
    flags (printed on stderr as "[transformers] The following generation flags are not valid ...")
    are not shown. In a subprocess: transformers' logger writes to the stream it found at import."""
    import subprocess
    import sys

    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": None, "temperature": 0.7, "top_k": 40,
                                                                 "eos_token_id": [7, 3]}))
    code = ("import sys; from hybridmoe.engine.model_files import _eos_ids; "
            "print(_eos_ids(sys.argv[1], None, None))")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[3, 7]", p.stderr
    assert "generation flags" not in p.stderr, p.stderr


def test_non_finite_expert_weights_at_load_time_name_the_expert(tiny_model_dir, tmp_path):
    """Load-time quantization (no --kt-weight-path) of a checkpoint with an infinity in an expert: one
    CheckpointError naming the layer, expert, projection and row (the native quantizer's check)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hybridmoe import LLM
    from hybridmoe.weights.loader import CheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir("qwen3_moe"), bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.2.mlp.experts.6.up_proj.weight"  # layer 1 is dense in this model
    tensors[name] = tensors[name].clone()
    tensors[name][20, 9] = float("inf")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 2 routed experts: expert 6 up_proj row 20: NaN or infinite"):
        LLM(str(bad), device="cpu", progress=False, kt_method="AMXINT8", kt_num_gpu_experts=0)


def test_dummy_weights_are_the_same_in_every_run():
    """--load-format dummy draws each tensor from a generator seeded by its name: two runs (whatever the
    global RNG state) build the same model, so benchmark runs compare one model and smoke tests are
    reproducible (bench_grammar's smoke test failed in one CI run of a model whose greedy text closed its JSON
    early)."""
    from hybridmoe.weights.fp8_loading import Fp8DummyReader
    from hybridmoe.weights.loader import DummyWeights

    def draw(reader, name, dtype=torch.float32):
        t = torch.empty(64, 48, dtype=dtype)
        reader.fill(name, t)
        return t

    torch.manual_seed(1)
    a = draw(DummyWeights(), "model.layers.0.self_attn.q_proj.weight")
    torch.manual_seed(2)
    assert torch.equal(a, draw(DummyWeights(), "model.layers.0.self_attn.q_proj.weight"))
    assert not torch.equal(a, draw(DummyWeights(), "model.layers.0.self_attn.k_proj.weight"))
    assert not torch.equal(a, draw(DummyWeights(seed=1), "model.layers.0.self_attn.q_proj.weight"))
    assert 0.015 < a.std().item() < 0.025 and torch.equal(draw(DummyWeights(), "model.norm.weight"),
                                                          torch.ones(64, 48))
    f8 = Fp8DummyReader(DummyWeights(), (128, 128))
    w = draw(f8, "model.layers.0.mlp.experts.0.up_proj.weight", torch.float8_e4m3fn)
    torch.manual_seed(3)
    assert torch.equal(w.view(torch.uint8),
                       draw(f8, "model.layers.0.mlp.experts.0.up_proj.weight", torch.float8_e4m3fn).view(torch.uint8))
