"""Tiny adapters for the LoRA tests: PEFT-made (the real `peft` library) on attention + MLP, and
hand-made PEFT-format directories with per-expert tensors (the convert-lora output format)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# attention only: with transformers 5, peft maps gate_proj/up_proj/down_proj targets of a Qwen3-MoE onto the
# routed experts' stacked parameters (its own fused form), dense layers' MLPs included; the dense MLP
# targets are covered by the hand-made adapters of `hand_adapter` instead
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def peft_adapter(base: Path, out: Path, seed: int, r: int = 4, alpha: float = 8.0, targets=None) -> Path:
    """A LoRA made by peft on the tiny model at `base`, with random (non-zero) A and B, saved to `out`."""
    import peft

    from tiny_models import hf_model

    model = hf_model(base)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ATTN, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.save_pretrained(str(out))
    return out


def hand_adapter(hf_cfg, out: Path, seed: int, r: int = 4, alpha: float = 8.0, layers=None,
                 with_attention: bool = True, with_experts: bool = True) -> Path:
    """A PEFT-format dir (convert-lora's output format) with per-expert LoRA
    (model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj) on every MoE layer when with_experts, the dense
    layers' MLP gate/up/down, and q/k/o_proj LoRA when with_attention."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i, e = hf_cfg.hidden_size, hf_cfg.moe_intermediate_size, hf_cfg.num_experts
    dense = set(getattr(hf_cfg, "mlp_only_layers", []) or [])
    layers = [x for x in range(hf_cfg.num_hidden_layers) if x not in dense] if layers is None else layers
    t: dict[str, torch.Tensor] = {}

    def pair(prefix: str, n_in: int, n_out: int) -> None:
        t[f"{prefix}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * 0.3
        t[f"{prefix}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * 0.3

    for layer in sorted(dense):
        p = f"base_model.model.model.layers.{layer}.mlp"
        pair(f"{p}.gate_proj", h, hf_cfg.intermediate_size)
        pair(f"{p}.up_proj", h, hf_cfg.intermediate_size)
        pair(f"{p}.down_proj", hf_cfg.intermediate_size, h)
    for layer in layers if with_experts else []:
        for x in range(e):
            p = f"base_model.model.model.layers.{layer}.mlp.experts.{x}"
            pair(f"{p}.gate_proj", h, i)
            pair(f"{p}.up_proj", h, i)
            pair(f"{p}.down_proj", i, h)
    if with_attention:
        heads, d = hf_cfg.num_attention_heads, hf_cfg.head_dim
        for layer in range(hf_cfg.num_hidden_layers):
            pair(f"base_model.model.model.layers.{layer}.self_attn.q_proj", h, heads * d)
            pair(f"base_model.model.model.layers.{layer}.self_attn.k_proj", h, hf_cfg.num_key_value_heads * d)
            pair(f"base_model.model.model.layers.{layer}.self_attn.o_proj", heads * d, h)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none", "task_type": "CAUSAL_LM",
        "target_modules": ["gate_proj", "up_proj", "down_proj", "q_proj", "k_proj", "o_proj"],
        "base_model_name_or_path": "tiny"}))
    return out


def merged_hf_model(base: Path, adapter_dir: Path):
    """transformers' model at `base` with the adapter merged into its weights (W + s B A), experts
    included (transformers 5 stacks them: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    from safetensors.torch import load_file

    from tiny_models import hf_model

    model = hf_model(base)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    s = cfg["lora_alpha"] / cfg["r"]
    w = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in w:
            if ".lora_A." not in key:
                continue
            mod = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            delta = s * (w[key.replace("lora_A", "lora_B")] @ w[key])  # [out, in]
            if ".experts." in mod:
                parent, e, proj = mod.rsplit(".", 2)
                inter = model.config.moe_intermediate_size
                if proj == "down_proj":
                    params[f"{parent}.down_proj"][int(e)] += delta
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    params[f"{parent}.gate_up_proj"][int(e), rows] += delta
            else:
                params[f"{mod}.weight"] += delta
    return model


# ---- KTransformers SFT output directories (the input of convert-lora) -----------------------------------
# non-expert key styles of a KTransformers SFT adapter_model.safetensors: PEFT's prefix or not, and the
# `orig_module` component of KTransformers' wrappers before or after the linear's name
KT_KEY_STYLES = ("base_model.model.model.layers.{L}.self_attn.{p}",
                 "base_model.model.model.layers.{L}.self_attn.{p}.orig_module",
                 "model.layers.{L}.self_attn.orig_module.{p}")


def kt_sft_dir(hf_cfg, out: Path, seed: int, r: int = 4, alpha: float | None = 8, nonexpert: bool = True,
               config: bool = True, dtype: torch.dtype = torch.bfloat16, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """A synthetic KTransformers SFT output directory at `out` for the model config `hf_cfg`:
    fused_expert_lora.safetensors (layers.{L}.experts.{gate,up,down}_lora_{a,b}, [E, ...], `dtype`) on
    every MoE layer; with `nonexpert` an adapter_model.safetensors with float32 q/k/v/o_proj LoRA on every
    layer (the key styles of KT_KEY_STYLES by layer); with `config` an adapter_config.json (lora_alpha
    omitted when alpha is None). Returns every tensor written, by its key."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i, e = hf_cfg.hidden_size, hf_cfg.moe_intermediate_size, hf_cfg.num_experts
    dense = set(getattr(hf_cfg, "mlp_only_layers", []) or [])

    def rnd(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(dt)

    fused: dict[str, torch.Tensor] = {}
    for layer in range(hf_cfg.num_hidden_layers):
        if layer in dense:
            continue
        p = f"layers.{layer}.experts"
        for proj in ("gate", "up"):
            fused[f"{p}.{proj}_lora_a"], fused[f"{p}.{proj}_lora_b"] = rnd(e, r, h), rnd(e, i, r)
        fused[f"{p}.down_lora_a"], fused[f"{p}.down_lora_b"] = rnd(e, r, i), rnd(e, h, r)
    out.mkdir(parents=True, exist_ok=True)
    save_file(fused, str(out / "fused_expert_lora.safetensors"))
    lin: dict[str, torch.Tensor] = {}
    if nonexpert:
        d, q, kv = hf_cfg.head_dim, hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads
        dims = {"q_proj": (h, q * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (q * d, h)}
        for layer in range(hf_cfg.num_hidden_layers):
            style = KT_KEY_STYLES[layer % len(KT_KEY_STYLES)]
            for proj, (n_in, n_out) in dims.items():
                k = style.format(L=layer, p=proj)
                lin[f"{k}.lora_A.weight"] = rnd(r, n_in, dt=torch.float32)
                lin[f"{k}.lora_B.weight"] = rnd(n_out, r, dt=torch.float32)
        save_file(lin, str(out / "adapter_model.safetensors"))
    if config:
        cfg = {"peft_type": "LORA", "r": r, "target_modules": ["self_attn.q_proj", "k_proj", "v_proj", "o_proj",
                                                              "gate_proj", "up_proj", "down_proj"],
               "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "rank_pattern": {}, "alpha_pattern": {},
               "use_rslora": False, "use_dora": False}
        if alpha is not None:
            cfg["lora_alpha"] = alpha
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    return {**fused, **lin}
