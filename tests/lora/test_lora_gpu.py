"""LoRA on CUDA (`-m gpu`; the lead runs these on the H200): fp32 parity of the wrapped linears and
GPU experts against the CPU run, CUDA graphs on and off giving the same tokens for a mixed batch
(the slot index is a graph input; adapters loaded after capture are used without a recapture)."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import hand_adapter, peft_adapter

from hybridmoe import LLM

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.mark.gpu
@pytest.mark.parametrize("moe_backend,fused", [("torch", False), ("triton", False), ("triton", True)],
                         ids=["torch", "triton", "triton-fused"])
def test_cuda_graphs_mixed_adapters(tiny_model_dir, tmp_path, moe_backend, fused, monkeypatch):
    """fused: every wrapped linear in the fused form (lora/linear.py; chosen by itself for bf16 linears whose
    slots' A rows are at most 1/8 of theirs, forced here for the tiny fp32 model): one GEMM over [W; A] and the
    expand kernel, in the graphs and eagerly, give the CPU run's tokens too."""
    from torch import nn
    from transformers import AutoConfig

    from hybridmoe.lora import linear

    if fused:
        monkeypatch.setattr(linear, "can_fuse", lambda base, rows, dtype, device: device.type == "cuda" and type(
            base) is nn.Linear and base.weight.dtype == dtype)

    base = tiny_model_dir("qwen3_moe")
    cfg = AutoConfig.from_pretrained(str(base))
    paths = [f"p1={peft_adapter(base, tmp_path / 'p1', seed=1)}", f"ex={hand_adapter(cfg, tmp_path / 'ex', seed=2)}"]
    late = peft_adapter(base, tmp_path / "late", seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 9, 26, 13)]
    loras = ["p1", None, "ex", "late"]
    cpu = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=paths + [f"late={late}"])
    want = [o["output_ids"] for o in cpu.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)]
    cpu.shutdown()
    for graphs in (True, False):
        llm = LLM(str(base), device="cuda", dtype="float32", progress=False, lora_paths=paths, moe_backend=moe_backend,
                  disable_cuda_graph=not graphs, cuda_graph_max_bs=8, max_total_tokens=4096)
        from hybridmoe.lora.engine_ops import load_adapter

        assert load_adapter(llm.engine, "late", str(late))["success"]  # after capture: no recapture
        wrapped = llm.engine.runner.lora.wrapped
        assert wrapped and all(w.fused == fused for w in wrapped.values())
        got = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)]
        assert got == want, (graphs, moe_backend, fused)
        assert (llm.engine.runner.graphs is not None) == graphs
        llm.shutdown()
