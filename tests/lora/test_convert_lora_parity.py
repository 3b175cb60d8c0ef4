"""Parity of a converted KTransformers fused-expert LoRA (acceptance, CPU): a tiny random Qwen3-MoE
stored in bf16 (the BF16 CPU method then holds exactly the checkpoint's experts), run in float32
(fp32 LoRA slots hold the adapter exactly), and a synthetic SFT directory (bf16 fused-expert LoRA on
every MoE layer plus float32 PEFT LoRA on q/k/v/o_proj of every layer, in KTransformers' key styles)
converted by convert-lora and served through the offline LLM with --kt-method BF16 and 0, some and
all experts on the GPU side: the greedy tokens are those of transformers on the same model with the
LoRA merged into its weights, W + s B A with s = lora_alpha / r, the merge computed here from the
*input* fused tensors (so a converter that permuted or transposed them would fail).

The cases with CPU experts need the native CPU expert LoRA kernels (lora/cpu_bridge.py); they skip
only where the CPU engine layer does not take LoRA slots."""

from __future__ import annotations

import re

import pytest
import torch
from lora_fixtures import kt_sft_dir

from hybridmoe import LLM
from hybridmoe.convert_lora import convert
from hybridmoe.cpu.engine import CPUMoELayer
from hybridmoe.lora import cpu_bridge
from hybridmoe.lora.cpu_bridge import CPUExpertLoRA

from tiny_models import hf_model

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
ALPHA, RANK = 8, 4


def _greedy(model, prompt: list[int], n: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _merged(base, tensors: dict[str, torch.Tensor], s: float):
    """transformers' model with the SFT tensors merged (float32): per expert W_e += s B[e] A[e] into the
    stacked gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]; attention W += s B A."""
    model = hf_model(base)
    params = dict(model.named_parameters())
    inter = model.config.moe_intermediate_size
    with torch.no_grad():
        for k, a in tensors.items():
            m = re.fullmatch(r"layers\.(\d+)\.experts\.(gate|up|down)_lora_a", k)
            if m:
                delta = s * torch.bmm(tensors[k[:-1] + "b"].float(), a.float())  # [E, out, in]
                p = f"model.layers.{m[1]}.mlp.experts"
                if m[2] == "down":
                    params[f"{p}.down_proj"] += delta
                else:
                    rows = slice(0, inter) if m[2] == "gate" else slice(inter, 2 * inter)
                    params[f"{p}.gate_up_proj"][:, rows] += delta
            elif k.endswith(".lora_A.weight"):
                mod = k.removeprefix("base_model.model.").replace(".orig_module", "").removesuffix(".lora_A.weight")
                params[f"{mod}.weight"] += s * (tensors[k.replace(".lora_A.", ".lora_B.")].float() @ a.float())
    return model


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    d = tmp_path_factory.mktemp("convparity")
    hf_model(tiny_model_dir("qwen3_moe")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    base = d / "bf16"
    cfg = AutoConfig.from_pretrained(str(base))
    tensors = kt_sft_dir(cfg, d / "sft", seed=11, r=RANK, alpha=ALPHA)
    convert(d / "sft", d / "ft", str(base))
    convert(d / "sft", d / "ft_attn", str(base), expert_dir=str(d / "ft_experts"))
    prompt = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    want = _greedy(_merged(base, tensors, ALPHA / RANK), prompt)
    base_ids = _greedy(hf_model(base), prompt)
    assert want != base_ids, "the adapter must change the output for the test to mean anything"
    return base, d, cfg, prompt, want, base_ids


def _skip_without_native(gpu_experts: int, num_experts: int) -> None:
    if gpu_experts < num_experts and not cpu_bridge.supported(CPUMoELayer):
        pytest.skip("needs native CPU expert LoRA")


@pytest.mark.parametrize("gpu_experts", [0, 4, 10], ids=["all_cpu", "hybrid", "all_gpu_side"])
def test_converted_adapter_parity(setup, gpu_experts):
    base, d, cfg, prompt, want, base_ids = setup
    _skip_without_native(gpu_experts, cfg.num_experts)
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, chunked_prefill_size=16,
              lora_paths=[f"ft={d / 'ft'}"], kt_method="BF16", kt_num_gpu_experts=gpu_experts)
    try:
        assert {b.experts.name for b in llm.engine.runner.model.moe_blocks()} == {"cpu" if gpu_experts == 0 else
                                                                                   "hybrid"}
        cpu_parts = [p for parts in llm.engine.runner.lora.expert_slots.values() for p in parts
                     if isinstance(p, CPUExpertLoRA)]
        assert len(cpu_parts) == (2 if gpu_experts < cfg.num_experts else 0)  # both MoE layers' CPU shares
        assert all(cpu_bridge.supported(p.layer) for p in cpu_parts)
        assert llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="ft")["output_ids"] == want
        outs = llm.generate(input_ids=[prompt, prompt], sampling_params=GREEDY, lora_path=[None, "ft"])
        assert [o["output_ids"] for o in outs] == [base_ids, want]
    finally:
        llm.shutdown()


def test_split_halves_parity(setup):
    """convert-lora --expert-output-dir D served as --lora-paths OUTPUT --kt-expert-lora-path D (hybrid)."""
    base, d, cfg, prompt, want, _ = setup
    _skip_without_native(4, cfg.num_experts)
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[f"ft={d / 'ft_attn'}"],
              kt_expert_lora_path=str(d / "ft_experts"), kt_method="BF16", kt_num_gpu_experts=4)
    try:
        assert llm.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="ft")["output_ids"] == want
    finally:
        llm.shutdown()
