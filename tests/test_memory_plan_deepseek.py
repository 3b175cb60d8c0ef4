"""The startup memory plan for the DeepSeek-V3 and Kimi-K2 shapes (the published configs,
tests/fixtures/configs) against numbers computed here by hand from the config: MLA attention
weights and KV cache, the first_k_dense_replace dense layers, shared experts, fp8 weights at one
byte plus a float32 scale per 128x128 block (kept in fp8, or dequantized when asked)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridmoe.moe.memory_plan import GiB, check_fits, kv_bytes_per_token, param_counts, plan_memory
from hybridmoe.moe.placement import place_experts
from hybridmoe.weights.loader import load_hf_config

from deepseek_fixtures import copy_fixture, spec_for

H, I_MOE, I_DENSE, Q_LORA, KV_LORA, NOPE, ROPE, V = 7168, 2048, 18432, 1536, 512, 128, 64, 128
SHAPES = {  # name: (vocab, heads, routed experts, dense layers); both have 61 layers and one shared expert
    "deepseek_v3": (129280, 128, 256, 3),
    "kimi_k2": (163840, 64, 384, 1),
}


def _attention_linears(heads: int) -> list[tuple[int, int]]:
    """MLA with q_lora_rank: q_a, q_b, kv_a (latent + rope key), kv_b (per-head nope key and value), o."""
    return [(Q_LORA, H), (heads * (NOPE + ROPE), Q_LORA), (KV_LORA + ROPE, H), (heads * (NOPE + V), KV_LORA),
            (H, heads * V)]


def _blocks(n: int, k: int) -> int:
    return math.ceil(n / 128) * math.ceil(k / 128)


def _hand_counts(name: str) -> dict[str, int]:
    vocab, heads, experts, dense = SHAPES[name]
    moe = 61 - dense
    attn = sum(n * k for n, k in _attention_linears(heads))
    norms = 61 * (2 * H + Q_LORA + KV_LORA) + H  # 2 per layer, q_a/kv_a layernorms, the final norm
    router = moe * (experts * H + experts)  # gate [E, H] and e_score_correction_bias [E]
    non_expert = (2 * vocab * H + 61 * attn + dense * 3 * H * I_DENSE + moe * 3 * H * I_MOE + router + norms)
    routed = moe * experts * 3 * H * I_MOE
    return {"non-expert": non_expert, "routed experts": routed, "total": non_expert + routed,
            "activated": non_expert - (vocab - 1) * H + moe * 8 * 3 * H * I_MOE}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request, tmp_path_factory):
    cfg = load_hf_config(str(copy_fixture(tmp_path_factory.mktemp("cfg"), request.param)))
    return request.param, cfg, spec_for(cfg)


def test_parameter_counts(model):
    name, cfg, spec = model
    assert param_counts(cfg, spec) == _hand_counts(name)


def test_parameter_counts_match_the_published_totals():
    """DeepSeek-V3: 671B parameters, 37B activated (its report, the main model without the MTP
    module); Kimi-K2: 1.04T, 32B activated (its model card: "1T" / "32B")."""
    ds, kimi = _hand_counts("deepseek_v3"), _hand_counts("kimi_k2")
    assert abs(ds["total"] / 671e9 - 1) < 0.002 and abs(ds["activated"] / 37e9 - 1) < 0.02
    assert abs(ds["non-expert"] / 17.1e9 - 1) < 0.01  # of which embeddings + LM head 1.85B, attention 11.4B
    assert abs(kimi["total"] / 1.04e12 - 1) < 0.02 and abs(kimi["activated"] / 32e9 - 1) < 0.02


def test_kv_cache_is_the_mla_latent(model):
    _, cfg, _ = model
    assert kv_bytes_per_token(cfg, 2) == 61 * (KV_LORA + ROPE) * 2  # 70272 bytes: vs 61 * 2 * 128 * 128 * 2 MHA
    from hybridmoe.config import ModelConfig

    m = ModelConfig(hf=cfg, spec=None, source="", num_layers=61, hidden_size=H, vocab_size=cfg.vocab_size,
                    num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    max_position=cfg.max_position_embeddings, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE)
    assert kv_bytes_per_token(cfg, 2) == 61 * m.kv_elements_per_token() * 2  # the runner's rule


def _plan(cfg, spec, n_gpu: int, **kw):
    masks = place_experts("uniform", list(spec.moe_layers), spec.num_experts, n_gpu)
    return plan_memory(cfg, spec, masks, 2, kw.pop("method", "AMXINT8"), 4096, 1, **kw), masks


def test_fp8_plan_against_hand_numbers(model):
    """fp8 checkpoint kept in fp8: decoder linear weights at 1 byte + 4 bytes per 128x128 block, but
    kv_b_proj in bf16 (dequantized at load for the absorbed decode); embeddings, LM head, norms,
    routers in bf16 (the bias in float32)."""
    name, cfg, spec = model
    vocab, heads, experts, dense = SHAPES[name]
    moe = 61 - dense
    fp8 = lambda n, k: n * k + 4 * _blocks(n, k)  # noqa: E731
    mlp = lambda i: 2 * fp8(i, H) + fp8(H, i)  # noqa: E731  (gate, up [I, H]; down [H, I])
    linears = _attention_linears(heads)
    kv_b = linears[3]
    assert kv_b == (heads * (NOPE + V), KV_LORA)
    attn = sum(fp8(n, k) for n, k in linears if (n, k) != kv_b) + kv_b[0] * kv_b[1] * 2
    norms = (61 * (2 * H + Q_LORA + KV_LORA) + H) * 2
    non_expert = (2 * vocab * H * 2 + 61 * attn + dense * mlp(I_DENSE) + moe * mlp(I_MOE)
                  + moe * (experts * H * 2 + experts * 4) + norms)
    plan, _ = _plan(cfg, spec, 32)
    assert plan.gpu["non-expert weights"] == non_expert
    assert plan.gpu_expert_bytes == mlp(I_MOE) == 3 * H * I_MOE + 4 * 3 * 16 * 56  # 44,050,944 bytes
    assert plan.gpu["GPU experts"] == moe * 32 * mlp(I_MOE)
    assert plan.gpu["KV cache (minimum)"] == 4096 * 61 * 576 * 2
    cpu = moe * (experts - 32) * 3 * H * I_MOE
    assert abs(plan.host["CPU experts"] / (cpu * (1 + 4 / 2048)) - 1) < 1e-9  # INT8: 1 byte + its scales
    if name == "deepseek_v3":  # 58 layers x 32 experts x 44 MB: 76 GiB; the whole GPU side under 100 GiB
        assert 76.0 < plan.gpu["GPU experts"] / GiB < 76.3 and 18.6 < plan.gpu["non-expert weights"] / GiB < 18.8
        assert sum(plan.gpu.values()) < 100 * GiB


def test_dequantized_fp8_is_the_model_dtype(model):
    name, cfg, spec = model
    fp8, _ = _plan(cfg, spec, 8)
    bf16, _ = _plan(cfg, spec, 8, gpu_fp8=False)
    assert bf16.gpu_expert_bytes == 3 * H * I_MOE * 2
    assert bf16.gpu["GPU experts"] == (61 - SHAPES[name][3]) * 8 * 3 * H * I_MOE * 2
    counts = _hand_counts(name)
    bias = SHAPES[name][2] * (61 - SHAPES[name][3])  # e_score_correction_bias: float32, 2 bytes more each
    assert bf16.gpu["non-expert weights"] == counts["non-expert"] * 2 + 2 * bias
    assert fp8.gpu["non-expert weights"] < 0.65 * bf16.gpu["non-expert weights"]


def test_fp8_cpu_method_and_prefill_buffers(model):
    name, cfg, spec = model
    experts, moe = SHAPES[name][2], 61 - SHAPES[name][3]
    plan, masks = _plan(cfg, spec, 32, method="FP8", prefill_threshold=1024)
    per = 3 * H * I_MOE
    # the CPU packing keeps a scale per 16 rows x 128 columns
    assert abs(plan.host["CPU experts"] - moe * (experts - 32) * per * (1 + 4 / (16 * 128))) < 1
    # one layer's CPU experts streamed as fp8 (in the CPU packing) to fp8 GPU experts: the GPU form + 2 staging slots
    ec = experts - 32
    assert abs(plan.gpu["prefill buffers"] - (ec * plan.gpu_expert_bytes + 2 * ec * per * (1 + 4 / (16 * 128)))) < 2
    bf16_gpu, _ = _plan(cfg, spec, 32, method="FP8", prefill_threshold=1024, gpu_fp8=False)
    assert bf16_gpu.gpu["prefill buffers"] > plan.gpu["prefill buffers"] + ec * per  # bf16 buffer + dequant temps


def test_a_plan_that_does_not_fit_names_the_experts_that_would(model):
    name, cfg, spec = model
    moe = 61 - SHAPES[name][3]
    plan, _ = _plan(cfg, spec, 64)
    budget = 80 * GiB
    spare = budget - (sum(plan.gpu.values()) - plan.gpu["GPU experts"])
    fit = spare // (plan.gpu_expert_bytes * moe)
    msg = check_fits(plan, budget, None, plan.gpu_expert_bytes, moe, 64)
    assert msg is not None and f"--kt-num-gpu-experts {fit} would fit" in msg
    assert 16 <= fit < 32  # ~44 MB fp8 experts: 80 GiB holds the non-expert part and 20-30 experts per layer


def test_masks_are_per_layer(model):
    _, _, spec = model
    masks = place_experts("uniform", list(spec.moe_layers), spec.num_experts, 4)
    assert all(isinstance(m, torch.Tensor) and int(m.sum()) == 4 for m in masks.values())


def test_prefill_lines_count_the_chunk_and_the_dequantized_buffer():
    """The prefill chunk's activations grow with its tokens; the layerwise buffer holds the streamed experts in
    the model dtype (dequantized from INT8), not in their fp8 GPU form."""
    from types import SimpleNamespace

    import torch

    from hybridmoe.moe.memory_plan import expert_params, plan_memory, prefill_activation_bytes

    cfg = SimpleNamespace(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, vocab_size=1000,
                          num_hidden_layers=2, quantization_config={"quant_method": "fp8",
                                                                    "weight_block_size": [128, 128]})
    spec = SimpleNamespace(moe_intermediate=2048, top_k=8, dense_intermediate=18432, moe_layers=[1],
                           num_experts=8, shared_intermediate=2048)
    per_tok = prefill_activation_bytes(cfg, spec, 2)
    assert per_tok == (128 * (4 * 192 + 128 + 2 * 128) + 4 * 7168) * 2  # MLA's temporaries are the largest here
    masks = {1: torch.tensor([True, False, False, True, False, False, False, False])}
    a = plan_memory(cfg, spec, masks, 2, "AMXINT8", 64, 1, prefill_threshold=1024, prefill_tokens=4096)
    b = plan_memory(cfg, spec, masks, 2, "AMXINT8", 64, 1, prefill_threshold=1024, prefill_tokens=8192)
    assert b.gpu["prefill activations"] == 2 * a.gpu["prefill activations"] == 8192 * per_tok
    e = expert_params(7168, 2048)
    assert a.gpu["prefill buffers"] >= 6 * (2 * e + 2 * e * 1.0)  # 6 streamed experts: bf16 buffer + 2 int8 slots
    fp8 = plan_memory(cfg, spec, masks, 2, "FP8", 64, 1, prefill_threshold=1024)
    assert fp8.gpu["prefill buffers"] < a.gpu["prefill buffers"]  # fp8 copied as it is: no bf16 buffer
