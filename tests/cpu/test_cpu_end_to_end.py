"""The CPU expert engine inside the model: `kt_num_gpu_experts=0` sends every routed expert of
every layer to it, quantized from the checkpoint at load (`kt_method`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.cpu.quant import dequantize_matrix, pack_matrix, pad_sizes

from tiny_models import hf_model, make_tiny_model

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A tiny Qwen3-MoE (H=72, I=40: not multiples of 64) stored in bf16, so the BF16 method
    holds exactly the checkpoint's weights."""
    d = tmp_path_factory.mktemp("e2e")
    hf_model(make_tiny_model("qwen3_moe", d / "f32")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    return d / "bf16"


def _prompt() -> list[int]:
    return torch.randint(0, 211, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_bf16_method_gives_the_torch_path_tokens(bf16_model):
    ref = LLM(str(bf16_model), device="cpu", progress=False)
    cpu = LLM(str(bf16_model), device="cpu", progress=False, kt_num_gpu_experts=0, kt_method="BF16")
    assert all(b.experts.name == "cpu" for b in cpu.engine.runner.model.moe_blocks())
    prompt = _prompt()
    assert _rel(cpu.prompt_logits(prompt), ref.prompt_logits(prompt)) < 1e-5
    assert cpu.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"] == \
        ref.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]


def _dequantized_copy(src, dst, method: str, group: int = 128):
    """The checkpoint with every routed expert matrix replaced by quantize -> dequantize: the
    torch path on it computes with exactly the weights the CPU engine holds."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if ".experts." in name:
            n, k = w.shape
            padded = torch.zeros(1, -(-n // 64) * 64, pad_sizes(k, k, method, group)[0])
            padded[0, :n, :k] = w.float()
            deq = dequantize_matrix(pack_matrix(padded, method, group), method, group)
            tensors[name] = deq.reshape(padded.shape)[0, :n, :k].to(w.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("method,weight_err", [("AMXINT8", 0.05), ("AMXINT4", 0.35)])
def test_integer_methods_logits_within_tolerance(bf16_model, tmp_path, method, weight_err):
    """Tolerance, justified: against the torch path on the dequantized weights (same bits), the only
    difference left is the per-token int8 quantization of activations (relative step ~1/127 per
    matmul input), so prompt logits agree within 3e-2. Against the unquantized model the weight
    quantization itself adds: int8 per-channel ~1% per matrix (bound 0.05), int4 groups of 128 on
    these Gaussian weights ~10% per matrix over two MoE layers (bound 0.35)."""
    prompt = _prompt()
    cpu = LLM(str(bf16_model), device="cpu", progress=False, kt_num_gpu_experts=0, kt_method=method)
    ours = cpu.prompt_logits(prompt)
    same_bits = LLM(str(_dequantized_copy(bf16_model, tmp_path / "deq", method)), device="cpu", progress=False)
    err_same = _rel(ours, same_bits.prompt_logits(prompt))
    print(f"{method}: vs same bits {err_same:.2e}")
    assert err_same < 3e-2
    exact = LLM(str(bf16_model), device="cpu", progress=False)
    assert _rel(ours, exact.prompt_logits(prompt)) < weight_err
