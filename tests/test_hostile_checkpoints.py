"""Hostile Hugging Face checkpoint directories: config.json values of the wrong type, out of range or absurdly
large, config.json that is not a JSON object, damaged safetensors files and indexes. Each is refused by the
startup checks (`hybridmoe.startup.prepare`, what `generate` and `serve` run before loading anything) with one
CheckpointError line naming the file and the field, quickly: never a hang, a giant allocation, or an error from
deep inside (TypeError, ZeroDivisionError, RecursionError...). A few run through the real command line: exit
code 2 and one line on stderr."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmoe.cli import main as cli_main
from hybridmoe.config import EngineArgs
from hybridmoe.startup import prepare
from hybridmoe.weights.errors import CheckpointError

from tiny_models import linked_with_json

REPO = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")
BIG = 2**31 - 1  # passes the integer checks; enumerating or allocating by it does not finish
# every case must fail fast: a hang (the bug some of them were) is a test failure, not a stuck run
pytestmark = pytest.mark.timeout(60)


def _yarn(**changes: object) -> dict:
    """A valid YaRN rope_parameters for the tiny qwen3_moe (max_position_embeddings 1024), with `changes`."""
    return dict({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
                **changes)


def _ds_yarn(**changes: object) -> dict:
    """The tiny deepseek_v3's rope_parameters (tiny_models.py) with `changes`."""
    return dict({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}, **changes)


# (case id, tiny model kind, config.json changes, the field the error line must name)
CONFIG_CASES: list[tuple[str, str, dict, str]] = [
    # wrong types (transformers' own validation, reported as one line naming the field)
    ("hidden_str", "qwen3_moe", {"hidden_size": "72"}, "hidden_size"),
    ("hidden_null", "qwen3_moe", {"hidden_size": None}, "hidden_size"),
    ("hidden_list", "qwen3_moe", {"hidden_size": [72]}, "hidden_size"),
    ("vocab_null", "qwen3_moe", {"vocab_size": None}, "vocab_size"),
    ("moe_inter_str", "qwen3_moe", {"moe_intermediate_size": "40"}, "moe_intermediate_size"),
    ("eps_str", "qwen3_moe", {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ("rope_params_list", "qwen3_moe", {"rope_parameters": [1, 2]}, "rope_parameters"),
    ("experts_alias_null", "qwen3_moe", {"num_local_experts": None}, "num_local_experts"),  # was TypeError: '>'
    ("model_type_list", "qwen3_moe", {"model_type": ["qwen3_moe"]}, "model_type"),  # was "unhashable type"
    ("quant_config_list", "qwen3_moe", {"quantization_config": [1]}, "quantization_config"),  # was "no to_dict"
    ("dtype_list", "qwen3_moe", {"dtype": [1]}, "dtype"),  # was "list index out of range"
    ("architectures_str", "qwen3_moe", {"architectures": "Qwen3MoeForCausalLM"}, "architecture"),
    # negative, zero and absurd sizes
    ("hidden_neg", "qwen3_moe", {"hidden_size": -72}, "hidden_size"),
    ("hidden_huge", "qwen3_moe", {"hidden_size": 10**30}, "hidden_size"),
    ("layers_zero", "qwen3_moe", {"num_hidden_layers": 0}, "num_hidden_layers"),
    ("layers_huge", "qwen3_moe", {"num_hidden_layers": BIG}, "num_hidden_layers"),  # was a hang (arch spec)
    ("layers_100k", "qwen3_moe", {"num_hidden_layers": 100_000}, "num_hidden_layers"),  # was a hang (model build)
    ("layers_past_checkpoint", "qwen3_moe", {"num_hidden_layers": 4}, "num_hidden_layers"),
    ("ds_layers_huge", "deepseek_v3", {"num_hidden_layers": BIG}, "num_hidden_layers"),  # was a MemoryError
    ("experts_zero", "qwen3_moe", {"num_local_experts": 0}, "num_local_experts"),  # was "tensor ... missing"
    ("experts_neg", "qwen3_moe", {"num_local_experts": -1}, "num_local_experts"),
    ("experts_huge", "qwen3_moe", {"num_local_experts": BIG}, "num_local_experts"),  # was a hang
    ("experts_past_checkpoint", "qwen3_moe", {"num_local_experts": 11}, "num_local_experts"),
    ("mixtral_experts_huge", "mixtral", {"num_local_experts": BIG}, "num_local_experts"),  # was a hang
    ("ds_experts_zero", "deepseek_v3", {"n_routed_experts": 0}, "n_routed_experts"),
    ("topk_above_experts", "qwen3_moe", {"num_experts_per_tok": 11}, "num_experts_per_tok"),
    ("topk_zero", "qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("moe_inter_zero", "qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ("heads_not_dividing_hidden", "mixtral", {"num_attention_heads": 3, "num_key_value_heads": 1},
     "num_attention_heads"),
    ("kv_heads_not_dividing", "qwen3_moe", {"num_key_value_heads": 4}, "num_key_value_heads"),
    ("kv_heads_zero", "qwen3_moe", {"num_key_value_heads": 0}, "num_key_value_heads"),  # was taken as "unset"
    ("head_dim_zero", "qwen3_moe", {"head_dim": 0}, "head_dim"),
    ("head_dim_neg", "qwen3_moe", {"head_dim": -16}, "head_dim"),
    ("vocab_zero", "qwen3_moe", {"vocab_size": 0}, "vocab_size"),
    ("max_pos_zero", "qwen3_moe", {"max_position_embeddings": 0}, "max_position_embeddings"),
    # was a 68 GB RoPE table at load
    ("max_pos_huge", "qwen3_moe", {"max_position_embeddings": BIG}, "max_position_embeddings"),
    ("mixtral_max_pos_huge", "mixtral", {"max_position_embeddings": BIG}, "max_position_embeddings"),
    ("mla_rope_dim_odd", "deepseek_v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ("mla_kv_lora_zero", "deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank"),
    # rms_norm_eps
    ("eps_zero", "qwen3_moe", {"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ("eps_neg", "qwen3_moe", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ("eps_nan", "qwen3_moe", {"rms_norm_eps": NAN}, "rms_norm_eps"),
    # RoPE: these passed the checks and made NaN cos/sin tables (NaN logits) or failed deep in the build
    ("rope_theta_zero", "qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta"),
    ("rope_theta_neg", "mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ("rope_theta_nan", "qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": NAN}}, "rope_theta"),
    ("rope_theta_inf", "qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": INF}}, "rope_theta"),
    ("rope_theta_str", "qwen3_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     "rope_theta"),
    ("rope_type_junk", "qwen3_moe", {"rope_parameters": {"rope_type": "nosuch", "rope_theta": 1e4}}, "rope type"),
    ("yarn_theta_one", "qwen3_moe", {"rope_parameters": _yarn(rope_theta=1.0)}, "rope_theta"),  # ZeroDivisionError
    ("yarn_factor_inf", "qwen3_moe", {"rope_parameters": _yarn(factor=INF)}, "factor"),
    ("yarn_factor_zero", "qwen3_moe", {"rope_parameters": _yarn(factor=0.0)}, "factor"),
    ("yarn_original_neg", "qwen3_moe", {"rope_parameters": _yarn(original_max_position_embeddings=-256)},
     "original_max_position_embeddings"),  # was "math domain error"
    ("yarn_attention_factor_nan", "qwen3_moe", {"rope_parameters": _yarn(attention_factor=NAN)}, "attention_factor"),
    ("yarn_mscale_str", "qwen3_moe", {"rope_parameters": _yarn(mscale="x", mscale_all_dim=1.0)}, "mscale"),
    ("ds_yarn_mscale_nan", "deepseek_v3", {"rope_parameters": _ds_yarn(mscale=NAN)}, "mscale"),
    ("ds_yarn_beta_nan", "deepseek_v3", {"rope_parameters": _ds_yarn(beta_fast=NAN)}, "beta_fast"),
    ("ds_yarn_theta_neg", "deepseek_v3", {"rope_parameters": _ds_yarn(rope_theta=-1.0)}, "rope_theta"),
    # grouped routing
    ("groups_not_dividing", "deepseek_v3", {"n_group": 3}, "n_group"),
]


def _model_with_config(src: Path, dst: Path, changes: dict) -> Path:
    """A model directory at dst: src's files (linked) with config.json changed by `changes`."""
    return linked_with_json(src, dst, "config.json", changes)


def _refused(model: Path) -> str:
    """The one-line CheckpointError message of the startup checks for `model`."""
    with pytest.raises(CheckpointError) as e:
        prepare(EngineArgs.from_kwargs(model_path=str(model), device="cpu"))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(("kind", "changes", "field"), [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_value_is_one_line_naming_the_field(tiny_model_dir, tmp_path, kind, changes, field):
    model = _model_with_config(tiny_model_dir(kind), tmp_path / "m", changes)
    msg = _refused(model)
    assert str(model / "config.json") in msg and field in msg, msg


def test_the_table_mutates_keys_the_tiny_models_have(tiny_model_dir):
    """The expert-count cases change the key transformers writes (qwen3_moe's num_experts is saved as
    num_local_experts): adding a second key instead would test nothing."""
    for kind, key in (("qwen3_moe", "num_local_experts"), ("mixtral", "num_local_experts"),
                      ("deepseek_v3", "n_routed_experts")):
        assert key in json.loads((tiny_model_dir(kind) / "config.json").read_text())


# ---- config.json that is not a (reasonable) JSON object -----------------------------------------
def _write_config(kind: str):
    def write(path: Path) -> None:
        f = path / "config.json"
        f.unlink()
        if kind == "not_json":
            f.write_text('{"architectures": ["Qwen3MoeForCausalLM"],')
        elif kind == "list":
            f.write_text("[1]")
        elif kind == "null":
            f.write_text("null")
        elif kind == "binary":
            f.write_bytes(b"\xff\xfe\x00garbage")
        elif kind == "deeply_nested":  # was a RecursionError from the JSON parser
            f.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
        elif kind == "huge":  # a sparse 1 TiB file: was read whole (a MemoryError, or the machine's memory)
            f.write_bytes(b"{")
            os.truncate(f, 1 << 40)
        elif kind == "directory":
            f.mkdir()
    return write


@pytest.mark.parametrize(("kind", "want"), [
    ("not_json", "config.json: not valid JSON"),
    ("list", "config.json: expected a JSON object, got a list"),
    ("null", "config.json: expected a JSON object, got a NoneType"),
    ("binary", "config.json: not valid JSON"),
    ("deeply_nested", "config.json: not valid JSON"),
    ("huge", "config.json: 1099511627776 bytes, more than a config.json file can be (16 MiB)"),
    ("directory", "no config.json"),
])
def test_config_json_not_an_object(tiny_model_dir, tmp_path, kind, want):
    model = _model_with_config(tiny_model_dir("qwen3_moe"), tmp_path / "m", {})
    _write_config(kind)(model)
    assert want in _refused(model)


# ---- damaged safetensors files and indexes --------------------------------------------------------
Q = "model.layers.0.self_attn.q_proj.weight"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_header(f: Path, change) -> None:
    """f with its JSON header changed by change(header) (the data left as it is)."""
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _damage(kind: str, model: Path) -> str:
    """Damage `model` one way; the text the error must contain (after the file's name)."""
    f = model / "model.safetensors"
    if kind == "header_length_huge":
        f.write_bytes(struct.pack("<Q", 2**63) + f.read_bytes()[8:])
        return "model.safetensors: not a readable safetensors file: header length 9223372036854775808"
    if kind == "header_not_json":
        f.write_bytes(struct.pack("<Q", 16) + b"not json at all!" + bytes(64))
        return "model.safetensors: not a readable safetensors file"
    if kind == "header_deeply_nested":  # was a RecursionError
        raw = b"[" * 50_000 + b"]" * 50_000
        f.write_bytes(struct.pack("<Q", len(raw)) + raw)
        return "model.safetensors: not a readable safetensors file"
    if kind == "dtype_unknown":
        _rewrite_header(f, lambda h: h[Q].update(dtype="F7"))
        return f"model.safetensors: tensor {Q!r}: a damaged header entry or an unsupported dtype"
    if kind == "dtype_wrong":  # the right name, size and shape, an integer dtype
        _rewrite_header(f, lambda h: h[Q].update(dtype="I32"))
        return f"model.safetensors: tensor {Q!r} has dtype I32; bf16, fp16 or fp32 expected"
    if kind == "offsets_past_the_end":
        _rewrite_header(f, lambda h: h[Q].update(data_offsets=[o + 10**9 for o in h[Q]["data_offsets"]]))
        return f"model.safetensors: tensor {Q!r} ends at byte"
    if kind == "shape_huge":
        _rewrite_header(f, lambda h: h[Q].update(shape=[2**40, 2**40]))
        return f"model.safetensors: tensor {Q!r}: F32 [1099511627776, 1099511627776] needs"
    if kind == "metadata_not_an_object":  # passed the checks; safetensors refused it at load
        _rewrite_header(f, lambda h: h.update(__metadata__=[1]))
        return "model.safetensors: not a readable safetensors file: __metadata__"
    if kind == "index_names_a_missing_shard":
        (model / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {Q: "model-00002-of-00002.safetensors"}}))
        return "model.safetensors.index.json lists model-00002-of-00002.safetensors"
    if kind == "index_deeply_nested":  # was a RecursionError
        (model / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
        return "model.safetensors.index.json: not a safetensors index"
    if kind == "index_huge":  # a sparse 1 TiB index: was read whole
        f = model / "model.safetensors.index.json"
        f.write_bytes(b"{")
        os.truncate(f, 1 << 40)
        return "model.safetensors.index.json: not a safetensors index (expected a weight_map of tensor -> file): 1099"
    if kind in ("index_names_a_parent_file", "index_names_an_absolute_file"):  # tensors from elsewhere on the host
        outside = "../m2/model.safetensors" if kind == "index_names_a_parent_file" else str(f)
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {Q: outside}}))
        return f"model.safetensors.index.json: not a safetensors index (expected a weight_map of tensor -> file): " \
               f"weight_map names {outside!r}, a file outside the model directory"
    if kind == "shard_is_a_fifo":  # was a hang: opening a FIFO for reading waits for a writer
        f.unlink()
        os.mkfifo(f)
        return "model.safetensors: not a readable safetensors file: not a regular file"
    raise AssertionError(kind)


SHARD_CASES = ["header_length_huge", "header_not_json", "header_deeply_nested", "dtype_unknown", "dtype_wrong",
               "offsets_past_the_end", "shape_huge", "metadata_not_an_object", "index_names_a_missing_shard",
               "index_deeply_nested", "index_huge", "index_names_a_parent_file", "index_names_an_absolute_file",
               "shard_is_a_fifo"]


@pytest.mark.parametrize("kind", SHARD_CASES)
def test_damaged_safetensors_is_one_line_naming_the_file(tiny_model_dir, tmp_path, kind):
    model = _copy(tiny_model_dir("qwen3_moe"), tmp_path / "m")
    want = _damage(kind, model)
    assert want in _refused(model)


def test_convert_refuses_an_absurd_expert_count_fast(tiny_model_dir, tmp_path, capsys):
    """`hybridmoe convert` lists every expert tensor of the config: 2^31-1 experts was a hang there too."""
    model = _model_with_config(tiny_model_dir("mixtral"), tmp_path / "m", {"num_local_experts": BIG})
    capsys.readouterr()  # the tiny model's first "Writing model shards" bar, when this test wrote it
    rc = cli_main(["convert", "--input-path", str(model), "--output", str(tmp_path / "out"), "--quant-method", "int8",
                   "--no-progress"])
    lines = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("hybridmoe convert: error: ") and "num_local_experts" in lines[0], lines
    assert not (tmp_path / "out").exists()


# ---- the real command line ------------------------------------------------------------------------
def _generate(model: Path, *more: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "--device", "cpu", "--model", str(model),
                           "--max-new-tokens", "2", *more], cwd=REPO, capture_output=True, text=True, timeout=50,
                          env=env)


def _one_error_line(r: subprocess.CompletedProcess, *want: str) -> None:
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("hybridmoe generate: error: ") and "Traceback" not in lines[0], lines
    for w in want:
        assert w in lines[0], (w, lines[0])
    assert r.stdout == ""


def test_generate_with_an_absurd_layer_count_exits_2(tiny_model_dir, tmp_path):
    """2^31-1 layers: was a hang before the first line of output."""
    model = _model_with_config(tiny_model_dir("qwen3_moe"), tmp_path / "m", {"num_hidden_layers": BIG})
    _one_error_line(_generate(model), f"{model}/config.json: num_hidden_layers is {BIG}")


def test_generate_with_model_pointing_at_a_file_exits_2(tiny_model_dir):
    f = tiny_model_dir("qwen3_moe") / "config.json"
    _one_error_line(_generate(f), f"--model-path {f}: not a directory")


def test_dummy_weights_too_large_for_the_host_exit_2_naming_the_config(tmp_path):
    """Sizes every check allows but no host holds (~560 GiB of embeddings and layers), with random weights: was the
    allocator's line ("you tried to allocate 274877906944 bytes"), naming neither the file nor a size field."""
    model = _model_with_config(REPO / "hybridmoe" / "demo_model", tmp_path / "m",  # it has a tokenizer
                               {"hidden_size": 65536, "vocab_size": 2**20, "num_hidden_layers": 512})
    _one_error_line(_generate(model, "--load-format", "dummy"), f"{model}/config.json: the model's weights on cpu need",
                    "hidden_size 65536", "vocab_size 1048576", "GiB are free there")


def test_check_room_counts_parameters_and_buffers_exactly(tiny_model_dir, monkeypatch):
    """The byte count is the meta model's parameters and buffers: one byte more than free is refused, exactly
    enough passes (so the check cannot refuse a model that fits)."""
    import torch

    from hybridmoe.models.base import MoECausalLM
    from hybridmoe.models.hf_config import load_config
    from hybridmoe.models.registry import arch_spec
    from hybridmoe.weights import loader

    cfg = load_config(tiny_model_dir("qwen3_moe"))
    with torch.device("meta"):
        model = MoECausalLM(cfg, arch_spec(cfg, "config.json"), 64)
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert need > 0
    monkeypatch.setattr(loader, "_free_bytes", lambda device: need)
    loader.check_room(model, torch.device("cpu"), "m/config.json")
    monkeypatch.setattr(loader, "_free_bytes", lambda device: need - 1)
    with pytest.raises(CheckpointError) as e:
        loader.check_room(model, torch.device("cpu"), "m/config.json")
    assert str(e.value).startswith("m/config.json: the model's weights on cpu need ") and "\n" not in str(e.value)
    monkeypatch.setattr(loader, "_free_bytes", lambda device: None)  # unknown: left to the allocator
    loader.check_room(model, torch.device("cpu"), "m/config.json")


def test_generate_with_a_prompt_past_the_context_is_one_line_without_a_class_name(tmp_path):
    """The engine's refusal of a request is reported as the flag errors are: its message names what is wrong (it
    was "RequestError: the prompt has ...")."""
    r = _generate(REPO / "hybridmoe" / "demo_model", "--context-length", "64", "--prompt", "hello world " * 100)
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]  # (after the load's log lines)
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("hybridmoe generate: error: the prompt has ") and "context length is 64" in errors[0]
