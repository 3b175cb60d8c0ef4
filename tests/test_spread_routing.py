"""benchmarks/spread_routing.py: with the shifted router logits a random-weight model's prompt reaches nearly every
expert in every layer (without them, past layer 0 it concentrates on a few: the reason the option exists)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hybridmoe import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import spread_routing  # noqa: E402
from bench_decode import add_shape_args, parse_shape_args, write_config  # noqa: E402

SHAPE = ["--layers", "4", "--experts", "64", "--hidden", "512", "--inter", "128", "--heads", "8", "--kv-heads", "2",
         "--head-dim", "64", "--vocab", "1000"]


def _spread(tmp_path: Path, install: bool) -> dict[int, torch.Tensor]:
    p = argparse.ArgumentParser()
    add_shape_args(p)
    a = parse_shape_args(p, SHAPE)
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    write_config(d, a)
    with LLM(str(d), device="cpu", dtype="float32", load_format="dummy", progress=False, skip_tokenizer_init=True,
             record_expert_distribution=str(tmp_path / "dist.json"), max_total_tokens=2048, context_length=1024) as llm:
        if install:
            assert spread_routing.install(llm) == a.layers
        ids = torch.randint(0, a.vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist()
        llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0})
        return {k: torch.tensor(v) for k, v in llm.engine.runner.recorder.recorded().items()}


def _top5(c: torch.Tensor) -> float:
    return float(c.sort(descending=True).values[:5].sum() / c.sum())


def test_spread_routing_reaches_every_expert(tmp_path):
    plain, spread = _spread(tmp_path, False), _spread(tmp_path, True)
    e = 64
    for layer, c in spread.items():
        assert int((c > 0).sum()) >= 0.95 * e and _top5(c) < 0.2, (layer, c.tolist())
    # the model's own routing, for the record: concentrated past layer 0 (seen: 40, 31, 23 of 64 experts)
    assert min(int((c > 0).sum()) for layer, c in plain.items() if layer > 0) < 0.8 * e
