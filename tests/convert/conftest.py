"""Fixtures for `hybridmoe convert`: tiny bf16 checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convert_helpers import run_convert
from tiny_models import hf_model, make_tiny_model


@pytest.fixture(scope="session")
def bf16_checkpoint(tmp_path_factory):
    """kind -> a tiny checkpoint of that kind stored in bf16 (as real checkpoints are)."""
    cache: dict[str, Path] = {}

    def get(kind: str, **overrides) -> Path:
        key = kind + repr(sorted(overrides.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp(kind)
            hf_model(make_tiny_model(kind, d / "f32", **overrides)).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
            cache[key] = d / "bf16"
        return cache[key]

    return get


@pytest.fixture(scope="module")
def converted(bf16_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, its int8 conversion) of a tiny Qwen3-MoE, one per test module; tests copy the
    conversion before damaging it."""
    src = bf16_checkpoint("qwen3_moe")
    out = tmp_path_factory.mktemp("conv") / "int8"
    assert run_convert(src, out, "int8") == 0
    return src, out
