"""The published DeepSeek-V3 and Kimi-K2 configs (tests/fixtures/configs) as model directories, and
the ArchSpec the tests use for them.

Until the DeepSeek model code registers `DeepseekV3ForCausalLM`, `spec_for` gives a stand-in built
here from the published rule (layers from first_k_dense_replace on, every moe_layer_freq-th, are
MoE; n_shared_experts shared experts of moe_intermediate_size): the config checks and the memory
plan read only these fields of a spec. Once the architecture is registered the registered spec is
used, so the same assertions check it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "configs"
CONFIGS = ("deepseek_v3", "kimi_k2")


def raw_config(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def model_dir(root: Path, name: str, **changes) -> Path:
    """A directory holding fixture `name` as config.json, with `changes` applied (None: key removed)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = raw_config(name)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def copy_fixture(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / f"{name}.json", d / "config.json")
    return d


def deepseek_registered() -> bool:
    import hybridmoe.models  # noqa: F401  (registers the built-in architectures)
    from hybridmoe.models.registry import ARCHITECTURES

    return "DeepseekV3ForCausalLM" in ARCHITECTURES


def spec_for(config):
    """The registered ArchSpec of a DeepSeek-family config, or the stand-in (see the module doc)."""
    if deepseek_registered():
        from hybridmoe.models.registry import arch_spec

        return arch_spec(config)
    from hybridmoe.models.base import ArchSpec

    k, freq = config.first_k_dense_replace, getattr(config, "moe_layer_freq", 1) or 1
    return ArchSpec(
        name="deepseek_v3 (test stand-in)", moe_module="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=bool(config.norm_topk_prob), num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok, moe_intermediate=config.moe_intermediate_size,
        dense_intermediate=config.intermediate_size,
        shared_intermediate=config.n_shared_experts * config.moe_intermediate_size,
        moe_layers=tuple(i for i in range(config.num_hidden_layers) if i >= k and i % freq == 0))
