"""Hostile LoRA adapters, names and loads, through the functions the entry points use:

- the server's /load_lora_adapter (its engine call engine_ops.load_adapter, and the route over HTTP):
  refused with one line naming the file and field, nothing of the server changed;
- the startup check of --lora-paths (startup.check_lora_flags, before the model loads): a ConfigError of one
  line; one real `hybridmoe generate` process: exit code 2 and that one line on stderr;
- the startup memory plan's look at the adapters' headers (lora/plan.header_info): never raises.

Most cases were gaps: an unhandled exception (a 500 from the route, a traceback), a hang, an allocation of the
size a file claims, an adapter served wrongly, or a bad config found only after the model had loaded. Some
cases the route already refused are in the table for the startup check and the one-line and nothing-changed
checks; ACCEPTED guards against refusing what the server does not use. Damaged tensors and patterns that were
already refused everywhere are in tests/lora/test_lora_bad_adapters.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lora_fixtures import hand_adapter
from safetensors.torch import load_file, save_file

from hybridmoe import LLM
from hybridmoe.config import ConfigError
from hybridmoe.lora import adapter as adapter_mod
from hybridmoe.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError, read_adapter
from hybridmoe.lora.engine_ops import load_adapter, unload_adapter
from hybridmoe.lora.plan import header_info
from hybridmoe.lora.setup import parse_lora_paths
from hybridmoe.startup import check_lora_flags

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
PROMPT = [5, 6, 7]
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = Q_A.replace("lora_A", "lora_B")
MAX_LOADED = 3  # --max-loaded-loras of the served model: "g" and at most two loaded by a test


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    base = tiny_model_dir("qwen3_moe")
    good = hand_adapter(AutoConfig.from_pretrained(str(base)), tmp_path_factory.mktemp("good") / "good", seed=1)
    llm = LLM(str(base), device="cpu", dtype="float32", progress=False, lora_paths=[f"g={good}"],
              max_loras_per_batch=2, max_lora_rank=8, lora_target_modules=["all"], max_loaded_loras=MAX_LOADED)
    ref = {None: llm.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"],
           "g": llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="g")["output_ids"]}
    yield llm, good, ref
    llm.shutdown()


def _unchanged(llm, ref) -> None:
    """Nothing of a refused load stays: the adapters and their answers are those of before."""
    assert llm.engine.runner.lora.names() == ["g"]
    for lora, tokens in ref.items():
        assert llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=lora)["output_ids"] == tokens


# ---- mutations of the good adapter's directory ----------------------------------------------------------
Mutation = Callable[[Path], None]


def cfg(**changes: object) -> Mutation:
    def f(d: Path) -> None:
        c = json.loads((d / CONFIG_FILE).read_text())
        c.update(changes)
        (d / CONFIG_FILE).write_text(json.dumps(c))
    return f


def cfg_drop(key: str) -> Mutation:
    def f(d: Path) -> None:
        c = json.loads((d / CONFIG_FILE).read_text())
        del c[key]
        (d / CONFIG_FILE).write_text(json.dumps(c))
    return f


def cfg_text(text: str | bytes) -> Mutation:
    def f(d: Path) -> None:
        (d / CONFIG_FILE).write_bytes(text.encode() if isinstance(text, str) else text)
    return f


def tensors(fn: Callable[[dict[str, torch.Tensor]], None]) -> Mutation:
    def f(d: Path) -> None:
        t = load_file(str(d / WEIGHTS_FILE))
        fn(t)
        save_file({k: v.clone().contiguous() for k, v in t.items()}, str(d / WEIGHTS_FILE))
    return f


def weights_bytes(data: bytes) -> Mutation:
    def f(d: Path) -> None:
        (d / WEIGHTS_FILE).write_bytes(data)
    return f


def header(h: dict, data_size: int = 0) -> Mutation:
    """A weights file of this header and `data_size` bytes of data (a sparse file: no disk taken)."""
    def f(d: Path) -> None:
        raw = json.dumps(h).encode()
        with open(d / WEIGHTS_FILE, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + data_size)
    return f


def sparse(name: str, size: int) -> Mutation:
    def f(d: Path) -> None:
        with open(d / name, "wb") as fh:
            fh.write(b"{")
            fh.truncate(size)
    return f


def fifo(name: str) -> Mutation:
    def f(d: Path) -> None:
        os.remove(d / name)
        os.mkfifo(d / name)
    return f


def symlink_loop(name: str) -> Mutation:
    def f(d: Path) -> None:
        os.remove(d / name)
        os.symlink(name, d / name)
    return f


def _set(key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(key, fn(t[key]))


TIB = 2**40
# name -> (mutation, words the one-line message must hold, whether the startup check (before the model loads)
# finds it too: what needs the model (its modules and sizes) or the tensors' values is found when it loads)
CASES: dict[str, tuple[Mutation, str, bool]] = {
    # adapter_config.json: r
    "r_zero": (cfg(r=0), "r is 0; expected a positive integer", True),
    "r_negative": (cfg(r=-4), "r is -4; expected a positive integer", True),
    "r_fraction": (cfg(r=4.5), "r is 4.5; expected a positive integer", True),  # was served as rank 4
    "r_bool": (cfg(r=True), "r is True; expected a positive integer", True),
    "r_string": (cfg(r="4"), "r is '4'; expected a positive integer", True),  # was served
    "r_infinite": (cfg_text('{"r": 1e400, "lora_alpha": 8}'), "r is inf; expected a positive integer", True),  # OverflowError
    "r_4301_digits": (cfg_text('{"r": ' + "9" * 4301 + "}"), "not valid JSON", True),  # int parsing limit
    "r_missing": (cfg_drop("r"), "r is missing; expected a positive integer", True),
    "r_huge": (cfg(r=2**31), "do not have rank 2147483648", True),
    # lora_alpha
    "alpha_string": (cfg(lora_alpha="8"), "lora_alpha must be a finite number, got '8'", True),  # was served
    "alpha_bool": (cfg(lora_alpha=True), "lora_alpha must be a finite number, got True", True),
    "alpha_nan": (cfg(lora_alpha=math.nan), "lora_alpha must be a finite number, got nan", True),
    "alpha_list": (cfg(lora_alpha=[8]), "lora_alpha must be a finite number, got [8]", True),
    # the scaling lora_alpha / r is a float32 on the server: this one was loaded, then the first forward with it
    # failed (its request got a 500) and leaked an adapter slot
    "alpha_beyond_float32": (cfg(lora_alpha=1e300), "beyond the float32 range", True),
    "alpha_pattern_beyond_float32": (cfg(alpha_pattern={"q_proj": 1e300}), "beyond the float32 range", True),
    # flags
    "rslora_string": (cfg(use_rslora="false"), "use_rslora must be true or false, got 'false'", True),
    "dora": (cfg(use_dora=True), "use_dora is not supported", True),
    "dora_string": (cfg(use_dora="no"), "use_dora must be true or false, got 'no'", True),
    "modules_to_save": (cfg(modules_to_save=["lm_head"]), "modules_to_save", True),
    "target_modules_number": (cfg(target_modules=5), "target_modules must be", True),
    "target_modules_list_of_numbers": (cfg(target_modules=[1, 2]), "target_modules must be", True),
    "peft_type_list": (cfg(peft_type=["LORA"]), "peft_type", True),
    # patterns: a huge key (compiled for every module)
    "rank_pattern_huge_key": (cfg(rank_pattern={"q" * 5000: 4}), "rank_pattern key of 5000 characters", True),
    # the file itself
    "config_list": (cfg_text("[1, 2]"), "expected a JSON object, got a list", True),  # AttributeError
    "config_null": (cfg_text("null"), "expected a JSON object, got null", True),
    "config_string": (cfg_text('"r"'), "expected a JSON object, got a string", True),
    "config_deep": (cfg_text("[" * 100_000 + "]" * 100_000), "nested too deeply", True),  # RecursionError
    "config_latin1": (cfg_text(b'{"r": 4, "x": "\xe9"}'), "not UTF-8", True),  # UnicodeDecodeError
    "config_sparse_1tib": (sparse(CONFIG_FILE, TIB), "an adapter config is at most", True),  # read it all
    "config_fifo": (fifo(CONFIG_FILE), "adapter_config.json is not a regular file", True),
    "config_symlink_loop": (symlink_loop(CONFIG_FILE), "adapter_config.json is not a regular file", True),
    # adapter_model.safetensors: not a safetensors file (SafetensorError: a 500 from the route)
    "weights_empty": (weights_bytes(b""), "not a readable safetensors file", True),
    "weights_garbage": (weights_bytes(b"\x00" * 100), "not a readable safetensors file", True),
    "weights_header_too_large": (weights_bytes(struct.pack("<Q", 2**63) + b"{}"), "not a readable safetensors",
                                 True),
    "weights_header_a_list": (header([1, 2]), "not a readable safetensors file", True),  # type: ignore[arg-type]
    "weights_fifo": (fifo(WEIGHTS_FILE), "adapter_model.safetensors is not a regular file", True),
    # a valid header claiming 1 TiB of data (a sparse file): was read into memory
    "weights_sparse_1tib": (header({"model.layers.0.self_attn.q_proj.lora_A.weight":
                                    {"dtype": "F32", "shape": [4, TIB // 16], "data_offsets": [0, TIB]},
                                    "model.layers.0.self_attn.q_proj.lora_B.weight":
                                    {"dtype": "F32", "shape": [96, 4], "data_offsets": [TIB, TIB + 1536]}},
                                   TIB + 1536), "GiB of host memory|unable to mmap", True),  # (which: the OS's overcommit)
    # one tensor twice (with and without PEFT's prefix, or .default): one of them was silently served
    "tensor_twice_prefix": (tensors(lambda t: t.__setitem__(Q_A.removeprefix("base_model.model."), t[Q_A] * 2)),
                            "given twice", True),
    "tensor_twice_default": (tensors(lambda t: t.__setitem__(Q_A.replace(".weight", ".default.weight"), t[Q_A] * 2)),
                             "given twice", True),
    "key_huge_layer_number": (tensors(lambda t: t.update({Q_A.replace("layers.0", "layers." + "9" * 5000): t[Q_A],
                                                          Q_B.replace("layers.0", "layers." + "9" * 5000): t[Q_B]})),
                              "characters", True),
    "tensor_1d": (tensors(_set(Q_A, lambda x: x.flatten())), "expected 2-D", True),
    "tensor_int32": (tensors(_set(Q_A, lambda x: x.to(torch.int32))), "is int32; expected a floating-point type", True),
    # values a float32 slot cannot hold (were served: every answer of the adapter NaN)
    "float64_beyond_float32": (tensors(_set(Q_B, lambda x: x.double() * 1e300)), "beyond the float32 range", False),
    # what the model decides (already refused; here for the one-line and nothing-changed checks)
    "rank_mismatch": (tensors(_set(Q_A, lambda x: x[:3])), "do not have rank 4", True),
    "wrong_hidden_size": (tensors(_set(Q_A, lambda x: x[:, :10])), "do not fit the module", False),
    "layer_past_the_model": (tensors(lambda t: t.update({k.replace("layers.0.", "layers.99."): v for k, v in
                                                         list(t.items()) if "layers.0.self_attn" in k})),
                             "unknown target module", False),
    "expert_past_the_model": (tensors(lambda t: t.update({k.replace("experts.0.", "experts.10."): v for k, v in
                                                          list(t.items()) if "layers.0.mlp.experts.0." in k})),
                              "the model's layer has 10 experts", False),
}


def _bad(good: Path, root: Path, case: str) -> Path:
    d = root / "bad"
    shutil.copytree(good, d)
    CASES[case][0](d)
    return d


def _one_line(msg: str, bad: Path, words: str) -> None:
    """One line naming the file and, with one of `words` (alternatives split by "|"), the field."""
    assert any(w in msg for w in words.split("|")) and str(bad) in msg, msg
    assert "\n" not in msg and len(msg) < 1000, msg[:2000]


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_route_refuses_and_nothing_changes(served, case, tmp_path):
    llm, good, ref = served
    bad = _bad(good, tmp_path, case)
    t0 = time.monotonic()
    out = load_adapter(llm.engine, "z", str(bad))
    if out["success"]:  # (taken back: the next cases start from the same server)
        unload_adapter(llm.engine, "z")
    assert out["success"] is False, out
    assert time.monotonic() - t0 < 10
    _one_line(out["error_message"], bad, CASES[case][1])
    assert out["loaded_adapters"] == {"g": str(good)}
    _unchanged(llm, ref)


@pytest.mark.parametrize("case", sorted(c for c, (_, _, startup) in CASES.items() if startup))
def test_startup_check_refuses_before_the_model_loads(served, case, tmp_path):
    _, good, _ = served
    bad = _bad(good, tmp_path, case)
    with pytest.raises(ConfigError) as e:
        check_lora_flags(SimpleNamespace(lora_paths=[f"z={bad}"], kt_expert_lora_path=None))
    assert str(e.value).startswith("--lora-paths: ")
    _one_line(str(e.value), bad, CASES[case][1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_memory_plan_header_look_never_raises(served, case, tmp_path):
    _, good, _ = served
    experts, rank = header_info(str(_bad(good, tmp_path, case)))
    assert isinstance(experts, bool) and isinstance(rank, int)


def test_generate_process_exits_2_with_one_line(served, tiny_model_dir, tmp_path):
    """The real command line: a bad adapter is one stderr line naming the file and field, exit code 2, before
    the model loads."""
    _, good, _ = served
    bad = _bad(good, tmp_path, "r_fraction")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "--device", "cpu", "--model-path",
                        str(tiny_model_dir("qwen3_moe")), "--lora-paths", f"z={bad}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=env)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hybridmoe generate: error: --lora-paths: ") and f"{bad}/{CONFIG_FILE}" in lines[0]
    assert "r is 4.5; expected a positive integer" in lines[0]


# what the server does not use is not held against an adapter: the weights say which modules and layers are
# adapted (target_modules, layers_to_transform and the base model's name are PEFT's recipe and provenance; a
# regex there is never compiled, a bomb included), and a zero or negative alpha is a valid (if odd) scaling
ACCEPTED: dict[str, Mutation] = {
    "other_base_model": cfg(base_model_name_or_path="some-org/another-model"),
    "layers_to_transform_past_the_model": cfg(layers_to_transform=[999], layers_pattern="layers"),
    "target_modules_empty": cfg(target_modules=[]),
    "target_modules_unknown": cfg(target_modules=["no_such_proj"]),
    "target_modules_regex_bomb": cfg(target_modules="((.|.|.)*)*!"),
    "target_modules_invalid_regex": cfg(target_modules="(q_proj"),
    "alpha_zero": cfg(lora_alpha=0),
    "alpha_negative": cfg(lora_alpha=-8),
    "r_whole_float": cfg(r=4.0),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_unused_fields_do_not_refuse(served, case, tmp_path):
    llm, good, ref = served
    d = tmp_path / "ok"
    shutil.copytree(good, d)
    ACCEPTED[case](d)
    out = load_adapter(llm.engine, "ok", str(d))
    assert out["success"], out
    tokens = llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="ok")["output_ids"]
    assert len(tokens) == 4 and (tokens == ref["g"] or case.startswith("alpha"))
    assert unload_adapter(llm.engine, "ok")["success"]
    _unchanged(llm, ref)


def test_adapter_dir_symlink_loop(served, tmp_path):
    llm, _, ref = served
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    out = load_adapter(llm.engine, "z", str(loop))
    assert not out["success"] and f"LoRA adapter '{loop}': not a directory" in out["error_message"], out
    with pytest.raises(ConfigError, match="not a directory"):
        check_lora_flags(SimpleNamespace(lora_paths=[f"z={loop}"], kt_expert_lora_path=None))
    out = load_adapter(llm.engine, "z", "/" + "a" * 5000)  # a name too long for the OS
    assert not out["success"] and "cannot be read" in out["error_message"] and len(out["error_message"]) < 1000
    _unchanged(llm, ref)


# ---- patterns ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_catastrophic_pattern_is_refused_quickly(served, field, tmp_path):
    """A backtracking bomb as a pattern key (Python's re took hours on every module path, on the engine
    thread: every request stalled); one that the `regex` module matches at once loads."""
    llm, good, ref = served
    d = tmp_path / "redos"
    shutil.copytree(good, d)
    cfg(**{field: {"(.|.|.)*!": 4, "(.*?)*(?<=x)y": 4}})(d)
    t0 = time.monotonic()
    out = load_adapter(llm.engine, "redos", str(d))
    assert time.monotonic() - t0 < 10, "the pattern hung the load"
    assert not out["success"]
    _one_line(out["error_message"], d, f"{field} key '(.*?)*(?<=x)y' took longer than 0.1 s to match model.layers.")
    _unchanged(llm, ref)
    cfg(**{field: {"(.|.|.)*!": 4, "((.*)*)*(.|.)*!": 4}})(d)  # (these match no module: the adapter is the good one)
    assert load_adapter(llm.engine, "redos", str(d))["success"]
    assert unload_adapter(llm.engine, "redos")["success"]


def test_pattern_budget_spent_is_one_line(served, tmp_path, monkeypatch):
    llm, good, ref = served
    d = tmp_path / "slow"
    shutil.copytree(good, d)
    cfg(alpha_pattern={"q_proj": 4})(d)
    monkeypatch.setattr(adapter_mod, "PATTERN_BUDGET_S", 0.0)
    out = load_adapter(llm.engine, "slow", str(d))
    assert not out["success"]
    _one_line(out["error_message"], d, "alpha_pattern: its patterns took longer than")
    _unchanged(llm, ref)


def test_layer_specific_patterns_follow_peft(served, tmp_path):
    """PEFT matches rank_pattern / alpha_pattern keys against the full module name (model.layers.0.self_attn.
    q_proj): a key naming one layer's module applies to that layer only. Such keys were matched against the
    path under the layer and never applied (the adapter served with the wrong scaling, silently)."""
    from peft.utils.other import get_pattern_key

    _, good, _ = served
    d = tmp_path / "layered"
    shutil.copytree(good, d)
    pattern = {"layers.0.self_attn.q_proj": 16.0, "model.layers.1.self_attn.o_proj": 32.0, "k_proj": 2.0}
    cfg(alpha_pattern=pattern)(d)
    ad = read_adapter(d)
    for (layer, module), lin in ad.linears.items():
        full = f"model.layers.{layer}.{module}"
        key = get_pattern_key(list(pattern), full)
        assert lin.scaling == pattern.get(key, 8.0) / 4, full


# ---- names ---------------------------------------------------------------------------------------------
BAD_NAMES = {"empty": "", "blank": "   ", "newline": "a\nb", "nul": "a\x00b", "zero_width": "a\u200bb",
             "too_long": "x" * 300, "padded": " a "}


@pytest.mark.parametrize("kind", sorted(BAD_NAMES))
def test_hostile_names_are_refused(served, kind):
    llm, good, ref = served
    name = BAD_NAMES[kind]
    out = load_adapter(llm.engine, name, str(good))
    if out["success"]:
        unload_adapter(llm.engine, name)
    assert not out["success"] and "LoRA adapter name" in out["error_message"], out
    assert "\n" not in out["error_message"] and len(out["error_message"]) < 1000
    _unchanged(llm, ref)
    with pytest.raises(LoRAAdapterError, match="LoRA adapter name|expected name=path"):
        parse_lora_paths([f"{name}={good}"])


def test_odd_but_fine_names_load(served):
    """Path separators, a colon and other scripts are fine in a name (SGLang's names are free-form)."""
    llm, good, ref = served
    for name in ("org/adapter", "ünï:cödé", "a#1"):
        assert load_adapter(llm.engine, name, str(good))["success"], name
        assert llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path=name)["output_ids"] == ref["g"]
        assert unload_adapter(llm.engine, name)["success"]
    assert load_adapter(llm.engine, "g", str(good))["error_message"].endswith("already loaded; unload it first")
    _unchanged(llm, ref)


def test_model_field_reaches_an_adapter_with_a_colon():
    """OpenAI `model` "<adapter>" where the adapter's name has a colon was parsed as "<served>:<adapter>"."""
    from hybridmoe.server.lora_routes import model_adapter

    mgr = SimpleNamespace(names=lambda: ["tiny:v2", "b"])
    state = SimpleNamespace(core=SimpleNamespace(runner=SimpleNamespace(lora=mgr)), model_name="tiny")
    assert model_adapter(state, "tiny:v2", ("tiny",)) == "tiny:v2"
    assert model_adapter(state, "tiny:b", ("tiny",)) == "b"


# ---- how many, and the slots -----------------------------------------------------------------------------
def test_max_loaded_loras_bounds_the_adapters_held(served):
    """--max-loaded-loras (SGLang's): adapters held in host memory at most; the load beyond is refused."""
    llm, good, ref = served
    names = [f"n{i}" for i in range(MAX_LOADED - 1)]
    for n in names:
        assert load_adapter(llm.engine, n, str(good))["success"]
    out = load_adapter(llm.engine, "one_more", str(good))
    assert not out["success"] and f"--max-loaded-loras {MAX_LOADED}" in out["error_message"], out
    assert unload_adapter(llm.engine, names[0])["success"]
    assert load_adapter(llm.engine, "one_more", str(good))["success"]  # room again
    for n in names[1:] + ["one_more"]:
        assert unload_adapter(llm.engine, n)["success"]
    _unchanged(llm, ref)


def test_max_loaded_loras_flag():
    from hybridmoe.config import EngineArgs

    assert EngineArgs.from_kwargs(model_path="m", max_loaded_loras=2, lora_paths=["a=x", "b=y"]).max_loaded_loras == 2
    for value, paths in ((0, None), (1, ["a=x", "b=y"]), (2.5, None)):
        with pytest.raises(ConfigError, match="--max-loaded-loras"):
            EngineArgs.from_kwargs(model_path="m", max_loaded_loras=value, lora_paths=paths)


def test_a_slot_fill_that_fails_gives_the_slot_back(served, monkeypatch):
    """A failure while an adapter is copied into a slot fails its request only; the slot was leaked before
    (after --max-loras-per-batch such failures no adapter could be served)."""
    llm, good, ref = served
    mgr = llm.engine.runner.lora
    assert load_adapter(llm.engine, "f", str(good))["success"]
    real = mgr._fill

    def boom(slot, prep):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(mgr, "_fill", boom)
    for _ in range(mgr.num_slots + 1):
        llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="f")  # its request fails
    monkeypatch.setattr(mgr, "_fill", real)
    assert sorted(mgr.free + list(mgr.slot_of.values())) == list(range(mgr.num_slots))
    assert llm.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="f")["output_ids"] == ref["g"]
    assert unload_adapter(llm.engine, "f")["success"]
    _unchanged(llm, ref)


# ---- the HTTP route --------------------------------------------------------------------------------------
def test_http_load_route_answers_400(served, tiny_model_dir, tmp_path):
    """Over HTTP: a bad adapter and a name that is the served model's are 400s naming them (a SafetensorError
    was a 500; an adapter named like the model was loaded and could never be asked for by `model`)."""
    import httpx

    from hybridmoe.config import EngineArgs
    from hybridmoe.engine.engine import Engine
    from tests.server.inproc import serve_in_thread

    _, good, _ = served
    base = tiny_model_dir("qwen3_moe")
    bad = _bad(good, tmp_path, "weights_garbage")
    engine = Engine(EngineArgs(model_path=str(base), device="cpu", dtype="float32", lora_paths=[f"g={good}"],
                               max_lora_rank=8, lora_target_modules=["all"]), progress=False)
    with serve_in_thread(lambda _: engine, model_path=str(base), served_model_name="tiny") as url:
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "z", "lora_path": str(bad)}, timeout=60)
        assert r.status_code == 400 and "not a readable safetensors file" in r.json()["error_message"], r.text
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(good)}, timeout=60)
        assert r.status_code == 400 and "served model" in r.json()["error_message"], r.text
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "ok", "lora_path": str(good)}, timeout=60)
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"g": str(good), "ok": str(good)}, r.text
