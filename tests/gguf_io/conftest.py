"""A tiny Qwen3-MoE (H 256, I 512: the GGUF kernels need multiples of 256; vocab 4096: the demo
model's tokenizer) written to GGUF once per session: experts Q4_K / Q6_K / Q8_0 by layer, the rest
F16 (vectors F32). Non-expert tensors are rounded to f16 in the directory too, so the directory and
the GGUF hold the same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import f16_exact, with_experts, write_model_gguf

from tiny_models import make_tiny_model

LAYER_TYPES = ("Q4_K", "Q6_K", "Q8_0")


@pytest.fixture(scope="session")
def qwen3_gguf(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(HF directory, the GGUF of the whole model, the HF directory with the GGUF's dequantized experts)."""
    d = tmp_path_factory.mktemp("gguf_model")
    ckpt = make_tiny_model("qwen3_moe", d / "hf", hidden_size=256, moe_intermediate_size=512, mlp_only_layers=[],
                           std=0.1, vocab_size=4096)
    f16_exact(ckpt)
    deq = write_model_gguf(ckpt, d / "tiny-qwen3moe.gguf", LAYER_TYPES)
    return ckpt, d / "tiny-qwen3moe.gguf", with_experts(ckpt, d / "same_bits", deq)


@pytest.fixture(autouse=True)
def _gguf_cache(tmp_path_factory, monkeypatch):
    """View directories (gguf/view.py) under the test's temporary directory, not ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
