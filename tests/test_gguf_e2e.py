"""--kt-method LLAMAFILE end to end: a tiny Qwen3-MoE (transformers) whose routed experts are written
to a GGUF file in the test with gguf's writer (layer 0 Q4_K, layer 1 Q6_K, layer 2 Q8_0, the GGUF
block count in the metadata), served with --kt-weight-path FILE.gguf, every routed expert on the CPU
engine's GGUF kernels, the rest of the model from the Hugging Face directory.

Tolerance, justified: against the torch path on the same (dequantized GGUF) expert weights, the only
difference is the kernels' per-token Q8_K-style activation quantization (x and the intermediate,
step amax/127 per 256 values: ~2% per MoE output on these Gaussian activations, measured in
tests/cpu/test_gguf_kernels.py). This model amplifies it over its 3 MoE layers: measured 6.9% on
the prompt logits, where AMXINT8 (per-row int8 activations) on the same weights measures 5.9%;
bound 0.10, and the greedy argmax must agree on at least 85% of the prompt positions (measured 94%,
the same as AMXINT8).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.config import ConfigError
from hybridmoe.cpu import gguf_quant as gq

from tiny_models import make_tiny_model

LAYER_TYPES = ("Q4_K", "Q6_K", "Q8_0")
E, H, INTER = 10, 256, 512  # the GGUF kernels need H, I multiples of 256; I != H catches a transposed matrix


def write_gguf(ckpt, path, layer_types=LAYER_TYPES, block_count=None, drop=None):
    """The checkpoint's routed experts as llama.cpp names them, quantized; returns the dequantized
    expert weights by checkpoint tensor name."""
    t = load_file(str(ckpt / "model.safetensors"))
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", len(layer_types) if block_count is None else block_count)
    w.add_uint32("qwen3moe.expert_count", E)
    deq = {}
    for layer, typ in enumerate(layer_types):
        for proj in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{proj}_exps.weight"
            if name == drop:
                continue
            stack = torch.stack([t[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(E)])
            rows = gq.quantize(stack, typ)
            w.add_tensor(name, rows.numpy(), raw_dtype=GGMLQuantizationType[typ])
            back = gq.dequantize(rows, typ)
            for e in range(E):
                deq[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = back[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_e2e")
    ckpt = make_tiny_model("qwen3_moe", d / "hf", hidden_size=H, moe_intermediate_size=INTER, mlp_only_layers=[],
                           std=0.1)
    deq = write_gguf(ckpt, d / "experts.gguf")
    same = d / "same_bits"  # the checkpoint with the experts the GGUF holds (dequantized)
    same.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (same / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors.update({k: v.to(tensors[k].dtype) for k, v in deq.items()})
    save_file(tensors, str(same / "model.safetensors"), metadata={"format": "pt"})
    return ckpt, d / "experts.gguf", same


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_llamafile_logits_match_torch_on_dequantized_experts(model):
    ckpt, gguf_file, same = model
    prompt = torch.randint(0, 211, (33,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(gguf_file))
    blocks = list(ours.engine.runner.model.moe_blocks())
    assert len(blocks) == 3 and all(b.experts.name == "cpu" for b in blocks)
    assert {b.experts.layer.kernel_name for b in blocks} <= {"gguf-avx2", "gguf-avx512", "gguf-amx"}
    got = ours.prompt_logits(prompt)
    ref = LLM(str(same), device="cpu", progress=False).prompt_logits(prompt)
    err = _rel(got, ref)
    print(f"LLAMAFILE vs torch on the dequantized experts: rel {err:.2e}")
    assert err < 0.10
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.85
    # the GGUF quantization itself moves the logits much more than that: the comparison is sensitive
    exact = LLM(str(ckpt), device="cpu", progress=False).prompt_logits(prompt)
    assert _rel(got, exact) > err


def test_mismatched_gguf_is_a_clear_error(model, tmp_path):
    ckpt, _, _ = model
    bad = tmp_path / "two_layers.gguf"
    write_gguf(ckpt, bad, layer_types=LAYER_TYPES[:2])
    with pytest.raises(ConfigError, match="2 layers .*block_count.*has 3"):
        LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(bad))
    missing = tmp_path / "missing.gguf"
    write_gguf(ckpt, missing, drop="blk.2.ffn_down_exps.weight")
    with pytest.raises(ConfigError, match="missing.gguf: no tensor blk.2.ffn_down_exps.weight"):
        LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(missing))
    with pytest.raises(ConfigError, match="kt-weight-path"):
        LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE")
