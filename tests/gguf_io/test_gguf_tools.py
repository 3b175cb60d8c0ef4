"""convert --input-type gguf, check --model FILE.gguf, the mismatch error naming both files, and the
GGUF layouts of Mixtral (llama.cpp's permuted q/k rows) and Qwen2-MoE (shared expert) served alone.

Tolerances: BF16 from the GGUF against torch on the dequantized weights: bf16 weights and bf16
activations in the CPU kernels, bound 2e-2 relative (measured 5e-3); AMXINT8: per-row int8 weights
and activations on top of the GGUF's own rounding, bound 0.10 (the LLAMAFILE bound, same order).
Mixtral / Qwen2-MoE with experts in F16-exact Q8_0 blocks against transformers on the same numbers:
the CPU kernels' activation rounding only, bound 0.10.
"""

from __future__ import annotations

import json

import pytest
import torch
from gguf_files import f16_exact, with_experts, write_model_gguf

from hybridmoe import LLM
from hybridmoe.check import check_main
from hybridmoe.config import ConfigError
from hybridmoe.convert import main as convert_main
from hybridmoe.weights.cpu_format import CPUWeightsError

from tiny_models import make_tiny_model

PROMPT = torch.randint(0, 190, (23,), generator=torch.Generator().manual_seed(7)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("quant,method,bound", [("bf16", "BF16", 2e-2), ("int8", "AMXINT8", 0.10)])
def test_convert_from_gguf_loads_and_matches(qwen3_gguf, tmp_path, quant, method, bound):
    _, gguf, same = qwen3_gguf
    out = tmp_path / quant
    assert convert_main(["--input-path", str(gguf), "--input-type", "gguf", "--output", str(out),
                         "--quant-method", quant, "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source_path"] == str(gguf) and manifest["source_experts_fingerprint"].startswith("gguf-blocks")
    llm = LLM(str(gguf), device="cpu", progress=False, kt_method=method, kt_weight_path=str(out))
    assert {b.experts.layer.kernel_name.split("-")[0] for b in llm.engine.runner.model.moe_blocks()} != {"gguf"}
    prompt = PROMPT[:20]
    err = _rel(llm.prompt_logits(prompt), LLM(str(same), device="cpu", progress=False).prompt_logits(prompt))
    print(f"convert --input-type gguf -> {method}: rel {err:.2e}")
    assert err < bound


def test_converted_gguf_is_refused_for_another_model(qwen3_gguf, tmp_path):
    ckpt, gguf, _ = qwen3_gguf
    out = tmp_path / "bf16"
    assert convert_main(["--input-path", str(gguf), "--input-type", "gguf", "--output", str(out),
                         "--quant-method", "bf16", "--no-progress"]) == 0
    with pytest.raises(CPUWeightsError, match="expert weights differ|converted from a different checkpoint"):
        LLM(str(ckpt), device="cpu", progress=False, kt_method="BF16", kt_weight_path=str(out))


def test_check_names_llamafile_and_the_types(qwen3_gguf, capsys):
    _, gguf, _ = qwen3_gguf
    assert check_main(["--model", str(gguf), "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["recommended_flags"]["--kt-method"] == "LLAMAFILE"
    assert report["gguf_tensor_types"]["experts"] == {"Q4_K": 3, "Q6_K": 3, "Q8_0": 3}
    assert set(report["gguf_tensor_types"]["other"]) == {"F16", "F32"}
    assert "GGUF blocks (Q4_K, Q6_K, Q8_0)" in report["method_reason"]
    check_main(["--model", str(gguf)])
    text = capsys.readouterr().out
    assert "GGUF experts   Q4_K x3, Q6_K x3, Q8_0 x3" in text and "--kt-method LLAMAFILE" in text


def test_mismatched_gguf_names_both_files(qwen3_gguf, tmp_path):
    ckpt, _, _ = qwen3_gguf
    bad = tmp_path / "two_layers.gguf"
    small = make_tiny_model("qwen3_moe", tmp_path / "small", hidden_size=256, moe_intermediate_size=256,
                            mlp_only_layers=[], vocab_size=4096, num_hidden_layers=2)
    write_model_gguf(small, bad, ("Q8_0",), experts_only=True)
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(bad))
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and str(ckpt) in msg and "2 layers" in msg
    same_layers = tmp_path / "narrow.gguf"  # 3 layers, experts of intermediate 256 where the model has 512
    write_model_gguf(make_tiny_model("qwen3_moe", tmp_path / "narrow", hidden_size=256, moe_intermediate_size=256,
                                     mlp_only_layers=[], vocab_size=4096), same_layers, ("Q8_0",), experts_only=True)
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(same_layers))
    msg = str(e.value)
    assert "\n" not in msg and str(same_layers) in msg and str(ckpt) in msg and "shape" in msg


@pytest.mark.parametrize("kind,arch,extra", [
    ("mixtral", "llama", dict(hidden_size=256, intermediate_size=256, vocab_size=4096)),
    ("qwen2_moe", "qwen2moe", dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=4096, mlp_only_layers=[])),
])
def test_other_architectures_from_gguf_alone(tmp_path, kind, arch, extra):
    ckpt = make_tiny_model(kind, tmp_path / "hf", std=0.1, **extra)
    f16_exact(ckpt)
    deq = write_model_gguf(ckpt, tmp_path / "m.gguf", ("Q8_0",), arch=arch)
    same = with_experts(ckpt, tmp_path / "same", deq)
    llm = LLM(str(tmp_path / "m.gguf"), device="cpu", progress=False)
    assert llm.engine.hf_config.model_type == kind
    ref = LLM(str(same), device="cpu", progress=False).prompt_logits(PROMPT)
    err = _rel(llm.prompt_logits(PROMPT), ref)
    print(f"{kind} from GGUF alone vs torch on the dequantized weights: rel {err:.2e}")
    assert err < 0.10
    # all experts torch-side: the same numbers everywhere, so only summation order differs
    allgpu = LLM(str(tmp_path / "m.gguf"), device="cpu", progress=False, kt_num_gpu_experts=llm.engine.model_config.spec.num_experts)
    assert _rel(allgpu.prompt_logits(PROMPT), ref) < 1e-4
