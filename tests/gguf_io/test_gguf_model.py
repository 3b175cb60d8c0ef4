"""`--model FILE.gguf` alone against `--model HFDIR --kt-weight-path FILE.gguf`, and GPU-side experts
from a GGUF (the CPU device runs the "GPU" experts in torch).

Tolerances: (a) LLAMAFILE against torch on the dequantized weights: bound 0.10 relative on the prompt
logits (the CPU kernels' per-token Q8_K activation quantization, measured 6.9% on this model; see
tests/test_gguf_e2e.py). (b) the GGUF alone against the directory plus GGUF experts: the same numbers
reach the same kernels, so the logits are equal (asserted to 1e-6). (c) experts moved to the torch side
leave the activation rounding of those experts: greedy tokens must agree up to the first step where
the all-torch reference's top-1/top-2 margin is below twice the largest prompt-logit difference measured
between the two in that margin (a near tie may go either way; tiny_models.assert_greedy_agrees).
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM
from hybridmoe.config import ConfigError

from tiny_models import assert_greedy_agrees

PROMPT = torch.randint(0, 4000, (29,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _margin_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest change of the reference's top-1 minus top-2 logit over the positions: what can flip
    a greedy choice."""
    idx = ref.float().topk(2, dim=-1).indices
    r, g = ref.float().gather(-1, idx), got.float().gather(-1, idx)
    return ((r[:, 0] - r[:, 1]) - (g[:, 0] - g[:, 1])).abs().max().item()


def _greedy(llm: LLM) -> list[int]:
    return llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]


def test_gguf_alone_equals_hf_dir_plus_gguf_experts(qwen3_gguf):
    ckpt, gguf, same = qwen3_gguf
    alone = LLM(str(gguf), device="cpu", progress=False)
    assert alone.args.kt_method == "LLAMAFILE" and alone.args.kt_weight_path == str(gguf)
    assert alone.args.served_model_name == str(gguf)
    cfg = alone.engine.hf_config
    assert (cfg.model_type, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.head_dim) == \
        ("qwen3_moe", 256, 512, 10, 16)
    split = LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(gguf))
    a, b = split.prompt_logits(PROMPT), alone.prompt_logits(PROMPT)
    assert (a - b).abs().max().item() < 1e-6
    assert _greedy(alone) == _greedy(split)
    ref = LLM(str(same), device="cpu", progress=False).prompt_logits(PROMPT)  # torch on the dequantized weights
    err = _rel(b, ref)
    print(f"GGUF alone vs torch on the dequantized weights: rel {err:.3f}")
    assert err < 0.10


def test_gguf_tokenizer_and_chat_template_are_the_demo_models(qwen3_gguf):
    from transformers import AutoTokenizer

    _, gguf, _ = qwen3_gguf
    tok = LLM(str(gguf), device="cpu", progress=False).tokenizer
    demo = AutoTokenizer.from_pretrained("hybridmoe/demo_model")
    for text in ("Hello world, how are you?", "  two spaces\nand a newline 1234", "<|im_start|>user\nhi<|im_end|>"):
        assert tok(text).input_ids == demo(text).input_ids, text
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        demo.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("gpu", [3, 10])
def test_gpu_side_experts_from_gguf_give_the_same_greedy_tokens(qwen3_gguf, gpu):
    _, gguf, _ = qwen3_gguf
    cpu_only = LLM(str(gguf), device="cpu", progress=False)
    ref = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=10)  # all: torch on dequantized blocks
    llm = ref if gpu == 10 else LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=gpu)
    assert llm.engine.runner.moe.backend == "hybrid"
    assert llm.engine.runner.moe.placement.gpu_experts(0) == gpu
    ref_tokens = _greedy(ref)
    logits = ref.prompt_logits(PROMPT + ref_tokens)[len(PROMPT) - 1: -1]
    top2 = logits.float().topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    tie = 2 * _margin_error(cpu_only.prompt_logits(PROMPT), ref.prompt_logits(PROMPT))
    for other in (llm, cpu_only):
        n = assert_greedy_agrees(_greedy(other), ref_tokens, margins, tie)
        assert n >= 4, (n, tie)  # the check compared a real stretch of tokens


def test_gguf_memory_plan_counts_the_block_bytes(qwen3_gguf):
    _, gguf, _ = qwen3_gguf
    llm = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=4)
    plan = llm.engine.runner.moe.memory_plan
    h, i, e = 256, 512, 10
    # Q4_K 144 bytes / 256 values, Q6_K 210, Q8_0 34 / 32 values: one expert = 3 * H * I values
    per_expert = {0: 3 * h * i * 144 // 256, 1: 3 * h * i * 210 // 256, 2: 3 * h * i * 34 // 32}
    assert plan.host["CPU experts (GGUF blocks)"] == sum((e - 4) * b for b in per_expert.values())
    assert plan.gpu["GPU experts"] == 3 * 4 * plan.gpu_expert_bytes


def test_bad_gguf_model_paths_are_one_line_errors(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ConfigError, match="a.gguf: not a readable GGUF file"):
        LLM(str(tmp_path / "a.gguf"), device="cpu", progress=False)
    with pytest.raises(ConfigError, match="no such GGUF file"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu", progress=False)


def test_startup_checks_accept_a_gguf_model(qwen3_gguf):
    """The server's checks before loading (startup.prepare: config, tokenizer, every tensor's shape, the
    GGUF experts) on a GGUF --model."""
    from hybridmoe.config import EngineArgs
    from hybridmoe.startup import prepare

    _, gguf, _ = qwen3_gguf
    args = prepare(EngineArgs.from_kwargs(model_path=str(gguf), device="cpu"))
    assert (args.kt_method, args.kt_weight_path, args.served_model_name) == ("LLAMAFILE", str(gguf), str(gguf))
