"""Damaged LoRA adapters loaded at run time (/load_lora_adapter's engine call) are refused with one
line naming the file and the key or field, and the server goes on as before.

Found by fuzzing adapter directories (each case below was accepted or raised an unhandled error
before): rank_pattern / alpha_pattern of the wrong type or with a bad regex raised TypeError /
ValueError / re.error out of the load; NaN weights, integer weights and a non-finite lora_alpha were
served.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from lora_fixtures import hand_adapter
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.lora.engine_ops import load_adapter, unload_adapter

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 6, 7]
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
EXPERT_KEY = "base_model.model.model.layers.2.mlp.experts.3.down_proj.lora_B.weight"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    base = tiny_model_dir("qwen3_moe")
    good = hand_adapter(AutoConfig.from_pretrained(str(base)), tmp_path_factory.mktemp("good") / "good", seed=1)
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[f"g={good}"],
              max_loras_per_batch=2, max_lora_rank=8, lora_target_modules=["all"])
    ref = {None: llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"],
           "g": llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="g")["output_ids"]}
    yield llm, good, ref
    llm.shutdown()


def _copy(good: Path, out: Path, tensors=None, config=None) -> Path:
    """The good adapter with tensors[key] = fn(tensor) applied and config fields replaced."""
    shutil.copytree(good, out)
    if tensors:
        t = load_file(str(out / "adapter_model.safetensors"))
        for key, fn in tensors.items():
            t[key] = fn(t[key]).contiguous()
        save_file(t, str(out / "adapter_model.safetensors"))
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _poke(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[3] = value
    return x


CASES = {
    "nan_weight": ({KEY: lambda x: _poke(x, math.nan)}, None, f"{KEY} holds NaN or infinite values"),
    "inf_expert_weight": ({EXPERT_KEY: lambda x: _poke(x, -math.inf)}, None,
                          f"{EXPERT_KEY} holds NaN or infinite values"),
    "fp8_nan_weight": ({KEY: lambda x: _poke(x, math.nan).to(torch.float8_e4m3fn)}, None, "holds NaN or infinite"),
    "int8_weight": ({KEY: lambda x: x.to(torch.int8)}, None, f"{KEY} is int8; expected a floating-point type"),
    "bool_weight": ({EXPERT_KEY: lambda x: x > 0}, None, "is bool; expected a floating-point type"),
    "rank_pattern_not_a_dict": (None, {"rank_pattern": 1e9}, "rank_pattern must map module patterns to numbers"),
    "rank_pattern_list": (None, {"rank_pattern": [99]}, "rank_pattern must map module patterns to numbers"),
    "rank_pattern_string_value": (None, {"rank_pattern": {"q_proj": "x"}},
                                  "rank_pattern['q_proj'] is 'x'; expected a positive integer"),
    "rank_pattern_fraction": (None, {"rank_pattern": {"q_proj": 2.5}}, "expected a positive integer"),
    "rank_pattern_bad_regex": (None, {"rank_pattern": {"q_proj(": 4}},
                               "rank_pattern key 'q_proj(' is not a valid pattern"),
    "alpha_pattern_string": (None, {"alpha_pattern": "4"}, "alpha_pattern must map module patterns to numbers"),
    "alpha_pattern_nan": (None, {"alpha_pattern": {"q_proj": math.nan}}, "expected a finite number"),
    "alpha_pattern_bool": (None, {"alpha_pattern": {"q_proj": True}}, "expected a finite number"),
    "lora_alpha_infinite": (None, {"lora_alpha": math.inf}, "lora_alpha must be a finite number, got inf"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_adapter_is_refused_and_nothing_changes(served, case, tmp_path):
    llm, good, ref = served
    tensors, config, words = CASES[case]
    bad = _copy(good, tmp_path / "bad", tensors, config)
    out = load_adapter(llm.engine, "z", str(bad))
    assert out["success"] is False, out
    msg = out["error_message"]
    assert words in msg and "\n" not in msg and str(bad) in msg, msg
    for lora, tokens in ref.items():  # nothing of it stays: the base and the good adapter answer as before
        assert llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=lora)["output_ids"] == tokens
    assert "z" not in llm.engine.runner.lora.names()


def test_a_finite_fp8_adapter_still_loads(served, tmp_path):
    llm, good, _ = served
    ok = _copy(good, tmp_path / "fp8", {KEY: lambda x: x.to(torch.float8_e4m3fn)})
    assert load_adapter(llm.engine, "f8", str(ok))["success"]
    assert len(llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="f8")["output_ids"]) == 4
    assert unload_adapter(llm.engine, "f8")["success"]
