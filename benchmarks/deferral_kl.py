"""KL divergence of next-token distributions with deferred CPU experts against no deferral.

Runs on the CPU (`--device cpu`, hybrid layer with BF16 CPU experts). Two models: the bundled demo
model (top-2 of 8 experts, trained: meaningful distributions) on a stretch of Python's own
documentation, and a tiny random Qwen3-MoE with top-8 of 32 experts (room for 1-4 deferred).

    python benchmarks/deferral_kl.py [--positions 512] [--out kl.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def kl_table(model: str, ids: list[int], n_gpu: int, deferred: list[int]) -> dict[int, float]:
    from hybridmoe import LLM

    def logprobs(d: int) -> torch.Tensor:
        llm = LLM(model, device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=n_gpu,
                  kt_max_deferred_experts_per_token=d)
        return torch.log_softmax(llm.prompt_logits(ids).double(), -1)

    base = logprobs(0)
    out = {}
    for d in deferred:
        lp = logprobs(d)
        out[d] = (base.exp() * (base - lp)).sum(-1).mean().item()  # mean over positions of KL(no defer || defer)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import pydoc

    from transformers import AutoTokenizer

    from hybridmoe.config import DEMO_MODEL_PATH

    from tiny_models import hf_model, make_tiny_model

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)
    text = pydoc.getdoc(json) + "\n" + pydoc.getdoc(argparse) + "\n" + pydoc.getdoc(pydoc)
    ids = tok.encode(text)[: a.positions]
    results = {"positions": len(ids)}
    results["demo (8 experts, top-2, 2 on GPU)"] = kl_table(DEMO_MODEL_PATH, ids, 2, [1, 2])
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model("qwen3_moe", Path(d) / "f32", std=0.05, num_experts=32, num_experts_per_tok=8,
                               mlp_only_layers=[], num_hidden_layers=4)
        hf_model(path).to(torch.bfloat16).save_pretrained(str(Path(d) / "bf16"))
        rnd = torch.randint(0, 211, (a.positions,), generator=torch.Generator().manual_seed(0)).tolist()
        results["tiny random (32 experts, top-8, 8 on GPU)"] = kl_table(str(Path(d) / "bf16"), rnd, 8, [1, 2, 3, 4])
    for name, row in results.items():
        if isinstance(row, dict):
            print(name + ": " + ", ".join(f"d={k}: KL {v:.2e}" for k, v in row.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
