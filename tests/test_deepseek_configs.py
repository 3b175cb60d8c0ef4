"""The published DeepSeek-V3 and Kimi-K2 config.json load through hybridmoe's config path (Kimi-K2's
`model_type: kimi_k2` without --trust-remote-code), pass the startup checks of config.json, and a
broken field is one line naming it; a remote-code tiktoken tokenizer (Kimi-K2's kind) is checked at
startup and loads with --trust-remote-code."""

from __future__ import annotations

import base64
import json
import textwrap
from pathlib import Path

import pytest

from hybridmoe.model_check import check_config, check_tokenizer
from hybridmoe.weights.loader import CheckpointError, load_hf_config

from deepseek_fixtures import CONFIGS, copy_fixture, deepseek_registered, model_dir, raw_config, spec_for

# the published values the model is built from (fixtures: tests/fixtures/configs)
EXPECTED = {
    "deepseek_v3": dict(num_hidden_layers=61, hidden_size=7168, vocab_size=129280, num_attention_heads=128,
                        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                        n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432, kv_lora_rank=512,
                        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid",
                        norm_topk_prob=True, max_position_embeddings=163840, num_nextn_predict_layers=1),
    "kimi_k2": dict(num_hidden_layers=61, hidden_size=7168, vocab_size=163840, num_attention_heads=64,
                    n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                    n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=18432, kv_lora_rank=512,
                    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    routed_scaling_factor=2.827, topk_method="noaux_tc", scoring_func="sigmoid",
                    norm_topk_prob=True, max_position_embeddings=131072, num_nextn_predict_layers=0,
                    bos_token_id=163584, eos_token_id=163585),
}
ROPE = {"deepseek_v3": (40, 10000, 32, 1), "kimi_k2": (32.0, 50000.0, 1.0, 1.0)}  # factor, theta, beta fast/slow


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_published_config_loads(name, trust, tmp_path):
    from transformers import DeepseekV3Config

    cfg = load_hf_config(str(copy_fixture(tmp_path, name)), trust_remote_code=trust)
    assert type(cfg) is DeepseekV3Config and cfg.architectures == ["DeepseekV3ForCausalLM"]
    for key, want in EXPECTED[name].items():
        got = getattr(cfg, key) if key != "num_nextn_predict_layers" else cfg.num_mtp_layers  # transformers' name
        assert got == want, (key, got, want)
    rope = cfg.rope_parameters
    factor, theta, fast, slow = ROPE[name]
    assert rope["rope_type"] == "yarn" and rope["factor"] == factor and rope["rope_theta"] == theta
    assert rope["original_max_position_embeddings"] == 4096 and (rope["beta_fast"], rope["beta_slow"]) == (fast, slow)
    assert rope["mscale"] == rope["mscale_all_dim"] == 1.0
    q = cfg.quantization_config
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128] and q["fmt"] == "e4m3"


def test_kimi_k2_is_read_as_deepseek_v3(tmp_path, caplog):
    """transformers has no kimi_k2 type and the directory has no configuration_deepseek.py: without
    the alias AutoConfig refuses it (remote code needed), with --trust-remote-code it fails (missing file)."""
    import logging

    d = copy_fixture(tmp_path, "kimi_k2")
    assert raw_config("kimi_k2")["model_type"] == "kimi_k2" and "AutoConfig" in raw_config("kimi_k2")["auto_map"]
    with caplog.at_level(logging.INFO, logger="hybridmoe.models.hf_config"):
        cfg = load_hf_config(str(d))
    assert cfg.model_type == "deepseek_v3"
    assert any("model_type 'kimi_k2' is read as transformers' deepseek_v3 config" in r.message for r in caplog.records)


def test_checkpoint_config_code_is_never_run(tmp_path):
    """--trust-remote-code (given for a tokenizer) does not switch the config to the checkpoint's own
    configuration_deepseek.py: hybridmoe's model code reads transformers' field names."""
    for name in CONFIGS:
        d = copy_fixture(tmp_path, name)
        (d / "configuration_deepseek.py").write_text("raise RuntimeError('the checkpoint config code ran')\n")
        assert type(load_hf_config(str(d), trust_remote_code=True)).__name__ == "DeepseekV3Config"


def test_unknown_model_type_still_goes_to_autoconfig(tmp_path):
    d = model_dir(tmp_path, "kimi_k2", model_type="no_such_model_type", auto_map=None)
    with pytest.raises(CheckpointError, match="config.json: cannot be read"):
        load_hf_config(str(d))


@pytest.mark.parametrize("name", CONFIGS)
def test_published_config_passes_the_checks(name, tmp_path):
    d = copy_fixture(tmp_path, name)
    cfg = load_hf_config(str(d))
    check_config(cfg, spec_for(cfg), raw_config(name), d / "config.json")


# (fixture, changes, the line's text after "config.json: ")
BROKEN = [
    ("deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank is 0, expected an integer >= 1"),
    ("kimi_k2", {"q_lora_rank": 0}, "q_lora_rank is 0, expected an integer >= 1"),
    # transformers' own validation refuses an odd rope size first: reported as one line all the same
    ("deepseek_v3", {"qk_rope_head_dim": 63}, "cannot be read: Class validation error for validator 'validate_rope'"),
    ("deepseek_v3", {"qk_rope_head_dim": 0}, "qk_rope_head_dim is 0, expected an integer >= 2"),
    ("kimi_k2", {"qk_nope_head_dim": 0}, "qk_nope_head_dim is 0, expected an integer >= 1"),
    ("kimi_k2", {"v_head_dim": -1}, "v_head_dim is -1, expected an integer >= 1"),
    ("deepseek_v3", {"n_group": 3}, "n_group is 3, expected a divisor of n_routed_experts (256)"),
    ("kimi_k2", {"n_group": 5}, "n_group is 5, expected a divisor of n_routed_experts (384)"),
    ("deepseek_v3", {"topk_group": 9}, "topk_group is 9, expected at most n_group (8)"),
    ("deepseek_v3", {"num_experts_per_tok": 300}, "num_experts_per_tok 300 is above n_routed_experts 256"),
    # 1 group of 8 of 64 groups of 4 experts: at most 4 experts reachable
    ("deepseek_v3", {"n_group": 64, "topk_group": 1},
     "num_experts_per_tok 8 is above the 4 experts of the topk_group selected groups"),
    ("deepseek_v3", {"first_k_dense_replace": 62}, "first_k_dense_replace is 62, expected at most num_hidden_layers"),
    ("kimi_k2", {"first_k_dense_replace": -1}, "first_k_dense_replace is -1, expected an integer >= 0"),
    ("kimi_k2", {"moe_layer_freq": 0}, "moe_layer_freq is 0, expected an integer >= 1"),
    ("kimi_k2", {"n_shared_experts": -1}, "n_shared_experts is -1, expected an integer >= 0"),
    ("deepseek_v3", {"topk_method": "top1"}, "topk_method is 'top1', expected one of greedy, group_limited_greedy"),
    ("deepseek_v3", {"scoring_func": "relu"}, "scoring_func is 'relu', expected one of softmax, sigmoid"),
    ("kimi_k2", {"routed_scaling_factor": 0.0}, "routed_scaling_factor is 0.0, expected a positive number"),
    ("deepseek_v3", {"moe_intermediate_size": 0}, "moe_intermediate_size is 0, expected an integer >= 1"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "quantization_config.weight_block_size is [128], expected two positive integers"),
]


@pytest.mark.parametrize("name,changes,want", BROKEN, ids=[f"{n}-{'-'.join(c)}" for n, c, _ in BROKEN])
def test_broken_field_is_one_line_naming_it(name, changes, want, tmp_path):
    from hybridmoe.model_check import load_checked_config

    d = model_dir(tmp_path, name, **changes)
    with pytest.raises(CheckpointError) as err:
        if want.startswith("cannot be read"):  # refused by transformers: the startup path makes it one line
            load_checked_config(str(d))
        cfg = load_hf_config(str(d))
        check_config(cfg, spec_for(cfg), json.loads((d / "config.json").read_text()), d / "config.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{d / 'config.json'}: "), msg
    assert want in msg, (want, msg)


def test_non_mla_configs_keep_the_head_checks(tmp_path):
    """The MLA branch is taken only with kv_lora_rank: a Qwen3-MoE head_dim is still checked."""
    from hybridmoe.models.qwen3_moe import qwen3_moe_spec

    d = tmp_path / "q"
    d.mkdir()
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 36,
           "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
    (d / "config.json").write_text(json.dumps(cfg))
    hf = load_hf_config(str(d))
    with pytest.raises(CheckpointError, match="num_attention_heads is 8, expected a divisor of hidden_size \\(36\\)"):
        check_config(hf, qwen3_moe_spec(hf), cfg, d / "config.json")


needs_arch = pytest.mark.skipif(not deepseek_registered(),
                                reason="DeepseekV3ForCausalLM is not registered yet (the DeepSeek model code)")


@needs_arch
@pytest.mark.parametrize("name", CONFIGS)
def test_model_config_resolves_the_deepseek_spec(name, tmp_path):
    from hybridmoe.model_check import load_checked_config
    from hybridmoe.models.config import model_config

    d = copy_fixture(tmp_path, name)
    hf, spec = load_checked_config(str(d))
    m = model_config(hf, str(d / "config.json"))
    e = EXPECTED[name]
    assert m.spec.num_experts == e["n_routed_experts"] and m.spec.top_k == 8
    assert m.moe_layers == tuple(range(e["first_k_dense_replace"], 61))
    assert m.spec.moe_intermediate == 2048 and m.spec.dense_intermediate == 18432
    assert m.spec.shared_intermediate == 2048  # one shared expert of the routed experts' size
    assert m.is_mla and m.kv_elements_per_token() == 512 + 64
    assert m.num_heads == e["num_attention_heads"] and m.num_layers == 61 and m.hidden_size == 7168


# ---- a remote-code tiktoken tokenizer (Kimi-K2 ships tokenization_kimi.py + tiktoken.model) ----

_TOKENIZER_MODULE = textwrap.dedent('''
    """A tiny tiktoken tokenizer given as the checkpoint's own code (the kind Kimi-K2 ships)."""
    import os

    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from transformers.tokenization_utils import PreTrainedTokenizer


    class TinyTikTokenizer(PreTrainedTokenizer):
        vocab_files_names = {"vocab_file": "tiktoken.model"}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, vocab_file, **kwargs):
            self.enc = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=r"\\S+|\\s+",
                                         mergeable_ranks=load_tiktoken_bpe(vocab_file), special_tokens={})
            super().__init__(**kwargs)

        @property
        def vocab_size(self):
            return self.enc.n_vocab

        def get_vocab(self):
            return {str(i): i for i in range(self.enc.n_vocab)}

        def _tokenize(self, text, **kwargs):  # tokens are id strings: the ids are tiktoken's
            return [str(i) for i in self.enc.encode(text)]

        def _convert_token_to_id(self, token):
            return int(token)

        def _convert_id_to_token(self, index):
            return str(index)

        def convert_tokens_to_string(self, tokens):
            return self.enc.decode([int(t) for t in tokens])
''')


def _remote_tokenizer(root: Path, module: str = _TOKENIZER_MODULE) -> Path:
    d = root / "tok"
    d.mkdir()
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]  # every byte, then merges
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    (d / "tokenization_tiny.py").write_text(module)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TinyTikTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTikTokenizer",
                                                                                None]}}))
    return d


def test_remote_tokenizer_needs_trust_remote_code(tmp_path):
    d = _remote_tokenizer(tmp_path)
    with pytest.raises(CheckpointError) as err:
        check_tokenizer(d)
    msg = str(err.value)
    assert "\n" not in msg and "tokenizer_config.json: the tokenizer TinyTikTokenizer is the checkpoint's own code " \
        "(tokenization_tiny.py): pass --trust-remote-code" in msg


def test_remote_tokenizer_missing_package_is_named(tmp_path):
    d = _remote_tokenizer(tmp_path, "import os\nimport no_such_tokenizer_pkg_xyz\nfrom transformers import AutoConfig\n"
                          "try:\n    import also_missing_but_optional\nexcept ImportError:\n    pass\n")
    with pytest.raises(CheckpointError) as err:
        check_tokenizer(d, trust_remote_code=True)
    assert str(err.value).endswith("tokenization_tiny.py: the tokenizer needs the package(s) no_such_tokenizer_pkg_xyz"
                                   ", not installed: `pip install no_such_tokenizer_pkg_xyz`")


def test_remote_tokenizer_module_missing_is_named(tmp_path):
    d = _remote_tokenizer(tmp_path)
    (d / "tokenization_tiny.py").unlink()
    with pytest.raises(CheckpointError, match="names the tokenizer TinyTikTokenizer in tokenization_tiny.py, which is "
                                              "missing"):
        check_tokenizer(d, trust_remote_code=True)


def test_remote_tiktoken_tokenizer_loads_with_trust_remote_code(tmp_path):
    pytest.importorskip("tiktoken", reason="tiktoken (pyproject's kimi and test extras) is not installed")
    from hybridmoe.config import EngineArgs
    from hybridmoe.engine.engine import _load_tokenizer

    d = _remote_tokenizer(tmp_path)
    assert check_tokenizer(d, trust_remote_code=True) is None  # no tokenizer.json: no size to check
    tok = _load_tokenizer(EngineArgs(model_path=str(d), trust_remote_code=True))
    ids = tok.encode("hello hello", add_special_tokens=False)
    assert ids == [259, 32, 259] and tok.decode(ids) == "hello hello"
