"""Tiny random-weight Hugging Face MoE checkpoints built with transformers, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# hidden not a power of two, top-k above 2; GQA ratio 1 (qwen2) and > 1 (qwen3, mixtral)
CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig", vocab_size=211, hidden_size=72, intermediate_size=96,
        moe_intermediate_size=40, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        num_experts=10, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mixtral": dict(
        cls="MixtralForCausalLM", cfg="MixtralConfig", vocab_size=203, hidden_size=80, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
        num_experts_per_tok=3, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=None,
        bos_token_id=None),
    "qwen2_moe": dict(
        cls="Qwen2MoeForCausalLM", cfg="Qwen2MoeConfig", vocab_size=199, hidden_size=60, intermediate_size=64,
        moe_intermediate_size=24, shared_expert_intermediate_size=56, num_hidden_layers=3, num_attention_heads=5,
        num_key_value_heads=5, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2,
        max_position_embeddings=1024, tie_word_embeddings=True),
    # MLA with q_lora_rank, noaux_tc over 4 groups keeping 2 (biased sigmoid selection), 1 shared
    # expert, 1 dense layer, YaRN with mscale != mscale_all_dim (cos/sin and softmax both scaled)
    "deepseek_v3": dict(
        cls="DeepseekV3ForCausalLM", cfg="DeepseekV3Config", vocab_size=197, hidden_size=60, intermediate_size=88,
        moe_intermediate_size=28, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
        q_lora_rank=36, kv_lora_rank=20, qk_nope_head_dim=10, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32, beta_slow=1, mscale=0.9, mscale_all_dim=0.7),
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None),
    # V2-Lite style: no q_lora_rank, softmax group_limited_greedy over 3 groups keeping 2, 2 shared
    # experts, 2 dense layers, routed scaling, YaRN (V2-Lite's mscale = mscale_all_dim)
    "deepseek_v2": dict(
        cls="DeepseekV2ForCausalLM", cfg="DeepseekV2Config", vocab_size=181, hidden_size=52, intermediate_size=76,
        moe_intermediate_size=20, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
        n_routed_experts=9, num_experts_per_tok=3, n_group=3, topk_group=2, topk_method="group_limited_greedy",
        n_shared_experts=2, first_k_dense_replace=2, routed_scaling_factor=1.5, norm_topk_prob=False,
        max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None),
}


def make_tiny_model(kind: str, path: Path, seed: int = 0, std: float = 0.2, head_std: float = 0.5,
                    **overrides) -> Path:
    """Save a random tiny model of `kind` to `path`; weights with a larger std than the default
    init so that logits are far from uniform and greedy decoding is not a coin toss."""
    spec = dict(CONFIGS[kind], **overrides)
    cls = getattr(transformers, spec.pop("cls"))
    cfg = getattr(transformers, spec.pop("cfg"))(**spec)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, head_std)
            else:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a bias that changes the selection
                b.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    return path


def hf_model(path: Path, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    return model.eval()


def assert_greedy_agrees(got: list[int], ref: list[int], ref_margins: torch.Tensor, tie: float) -> int:
    """bf16 greedy tokens against a reference's: identical up to the first step whose reference
    top-1/top-2 logit margin is below `tie` (there the two numerics may pick either token, and the
    sequences may part from then on). Returns how many tokens were compared.

    ref_margins [len(ref)]: top-1 minus top-2 of the reference logits that chose each ref token."""
    n = len(ref)
    near = (ref_margins < tie).nonzero()
    upto = int(near[0]) + 1 if len(near) else n  # the near-tie step itself may go either way
    assert got[: upto - 1] == ref[: upto - 1] and len(got) == n, (got, ref, upto, ref_margins.tolist())
    return upto


def greedy_margins(prompt_logits, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Top-1 minus top-2 logits at the steps that chose `tokens` after `prompt` (teacher forcing):
    prompt_logits is a callable giving [len, V] logits for a token list."""
    logits = prompt_logits(prompt + tokens[:-1])[len(prompt) - 1:].float()  # [len(tokens), V]
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def lm_head_inputs(llm, prompt: list[int], sampling_params: dict) -> tuple[list[int], list[torch.Tensor]]:
    """CPU-only decode (the native dense linears installed): the greedy tokens and the LM head's
    one-row inputs (the prompt's last row, then each decode step's)."""
    lm = llm.engine.runner.dense_linears.modules["lm_head"]
    native_fwd = lm.forward
    seen: list[torch.Tensor] = []
    lm.forward = lambda x: (seen.append(x.clone()) if x.shape[0] == 1 else None) or native_fwd(x)
    try:
        out = llm.generate(input_ids=prompt, sampling_params=sampling_params)["output_ids"]
    finally:
        lm.forward = native_fwd
    return out, seen


DROP = object()  # in linked_with_json's changes: remove the key


def linked_with_json(src: Path, dst: Path, name: str, changes: dict) -> Path:
    """A model directory at dst: src's files linked, except the JSON file `name`, written with `changes` applied (a
    value DROP removes the key; NaN and Infinity are written as Python's json writes them)."""
    import json

    dst.mkdir()
    for f in src.iterdir():
        if f.name != name:
            (dst / f.name).symlink_to(f)
    data = json.loads((src / name).read_text())
    for key, value in changes.items():
        if value is DROP:
            data.pop(key, None)
        else:
            data[key] = value
    (dst / name).write_text(json.dumps(data))
    return dst


def one_line(e, *want: str) -> str:
    """The message of a raised error (a pytest.ExceptionInfo), asserted to be one line holding every `want`."""
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in want:
        assert w in msg, (w, msg)
    return msg
