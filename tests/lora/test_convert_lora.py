"""`hybridmoe convert-lora` on synthetic KTransformers SFT directories of the tiny Qwen3-MoE's shapes
(lora_fixtures.kt_sft_dir), with and without the non-expert adapter: the output keys, shapes, dtypes
and adapter_config.json exactly; the split output directories; every malformed input a one-line
error naming the file/key with exit code 2 and nothing written; the streaming writer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_fixtures import kt_sft_dir
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridmoe.cli import main as cli_main
from hybridmoe.convert_lora import convert
from hybridmoe.lora.adapter import read_adapter
from hybridmoe.lora.kt_checkpoint import ConvertLoRAError
from hybridmoe.weights.safetensors_stream import Entry, StreamWriter

ROOT = Path(__file__).resolve().parents[2]
EXPERT_PROJS = ["down_proj", "gate_proj", "up_proj"]
ATTN = ["k_proj", "o_proj", "q_proj", "v_proj"]


@pytest.fixture(scope="module")
def cfg():
    import transformers

    from tiny_models import CONFIGS

    spec = dict(CONFIGS["qwen3_moe"])
    spec.pop("cls")
    return getattr(transformers, spec.pop("cfg"))(**spec)


def _expected(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The output tensors by the issue's rules, from the input tensors."""
    out = {}
    for k, t in tensors.items():
        m = re.fullmatch(r"layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)", k)
        if m:
            for e in range(t.shape[0]):
                out[f"model.layers.{m[1]}.mlp.experts.{e}.{m[2]}_proj.lora_{m[3].upper()}.weight"] = t[e]
        else:
            out[k.removeprefix("base_model.model.").replace(".orig_module", "")] = t
    return out


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(path / "adapter_model.safetensors")), json.loads((path / "adapter_config.json").read_text())


def _run(*args) -> int:
    return cli_main(["convert-lora", *map(str, args)])


@pytest.mark.parametrize("nonexpert", [True, False], ids=["with_nonexpert", "experts_only"])
def test_output_exact(cfg, tmp_path, nonexpert, capsys):
    src, out = tmp_path / "sft", tmp_path / "out"
    tensors = kt_sft_dir(cfg, src, seed=1, nonexpert=nonexpert, config=nonexpert, alpha=8)
    flags = [] if nonexpert else ["--lora-alpha", "16"]  # no adapter_config.json: the flag gives alpha
    assert _run(src, out, "--base-model-name-or-path", "org/tiny-moe", *flags) == 0
    assert f"--lora-paths NAME={out}" in capsys.readouterr().out
    got, conf = _read(out)
    want = _expected(tensors)
    assert sorted(got) == sorted(want)
    h, i, r = cfg.hidden_size, cfg.moe_intermediate_size, 4
    n_moe = cfg.num_hidden_layers - len(cfg.mlp_only_layers)
    assert sum(".experts." in k for k in got) == n_moe * cfg.num_experts * 6
    assert sum(".experts." not in k for k in got) == (cfg.num_hidden_layers * 8 if nonexpert else 0)
    shapes = {"gate_proj.lora_A": (r, h), "gate_proj.lora_B": (i, r), "up_proj.lora_A": (r, h),
              "up_proj.lora_B": (i, r), "down_proj.lora_A": (r, i), "down_proj.lora_B": (h, r)}
    for k, t in got.items():
        assert torch.equal(t, want[k]) and t.dtype == want[k].dtype, k  # bytes and dtype unchanged, no scaling
        if ".experts." in k:
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == shapes[k.split(".experts.")[1].split(".", 1)[1]
                                                                            .removesuffix(".weight")], k
        else:
            assert t.dtype == torch.float32
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert conf == {"peft_type": "LORA", "r": 4, "lora_alpha": 8 if nonexpert else 16,
                    "target_modules": sorted(EXPERT_PROJS + (ATTN if nonexpert else [])), "bias": "none",
                    "task_type": "CAUSAL_LM", "base_model_name_or_path": "org/tiny-moe"}
    ad = read_adapter(out)  # hybridmoe loads it: experts per layer, the attention linears
    assert sorted(ad.raw_experts) == [0, 2] and all(len(p) == cfg.num_experts for _, p in ad.raw_experts.values())
    assert len(ad.linears) == (cfg.num_hidden_layers * 4 if nonexpert else 0)
    assert {lin.scaling for lin in ad.linears.values()} <= {2.0}
    assert not list(out.glob("*.tmp"))


def test_config_alpha_wins_and_progress(cfg, tmp_path, caplog):
    src = tmp_path / "sft"
    kt_sft_dir(cfg, src, seed=2, alpha=8)
    with caplog.at_level("INFO", logger="hybridmoe.convert_lora"):
        convert(src, tmp_path / "out", "tiny", lora_alpha=32)
    assert _read(tmp_path / "out")[1]["lora_alpha"] == 8
    assert any("--lora-alpha 32 ignored" in r.message for r in caplog.records)
    layer_lines = [r.message for r in caplog.records if r.message.startswith("layer ")]
    assert [m.split(":")[0] for m in layer_lines] == ["layer 0", "layer 2"]  # one line per MoE layer


def test_config_r_unchecked_without_nonexpert(cfg, tmp_path):
    """adapter_config's r must equal the experts' rank only when non-expert tensors exist."""
    src = tmp_path / "sft"
    kt_sft_dir(cfg, src, seed=12, nonexpert=False)
    c = json.loads((src / "adapter_config.json").read_text())
    (src / "adapter_config.json").write_text(json.dumps({**c, "r": 8}))
    convert(src, tmp_path / "out", "tiny")
    assert _read(tmp_path / "out")[1]["r"] == 4


@pytest.mark.parametrize("flag", ["--expert-output-dir", "--nonexpert-output-dir"])
def test_split_dirs(cfg, tmp_path, flag):
    src, out, other = tmp_path / "sft", tmp_path / "out", tmp_path / "d" / "half"
    tensors = kt_sft_dir(cfg, src, seed=3)
    assert _run(src, out, "--base-model-name-or-path", "tiny", flag, other) == 0
    exp_dir, lin_dir = (other, out) if flag == "--expert-output-dir" else (out, other)
    (ew, ec), (lw, lc) = _read(exp_dir), _read(lin_dir)
    want = _expected(tensors)
    assert sorted(ew) == sorted(k for k in want if ".experts." in k)
    assert sorted(lw) == sorted(k for k in want if ".experts." not in k)
    assert all(torch.equal(t, want[k]) for k, t in {**ew, **lw}.items())
    assert ec["target_modules"] == EXPERT_PROJS and lc["target_modules"] == ATTN
    assert {ec["r"], lc["r"], ec["lora_alpha"], lc["lora_alpha"]} == {4, 8}
    # served as --lora-paths LIN --kt-expert-lora-path EXP
    ad = read_adapter(lin_dir)
    ad.merge(read_adapter(exp_dir))
    assert sorted(ad.raw_experts) == [0, 2] and len(ad.linears) == cfg.num_hidden_layers * 4


def test_peft_loads_the_nonexpert_half(cfg, tiny_model_dir, tmp_path):
    """The non-expert output (keys without base_model.model.) loads in peft with every tensor in place."""
    peft = pytest.importorskip("peft")
    from tiny_models import hf_model

    src, out = tmp_path / "sft", tmp_path / "out"
    tensors = kt_sft_dir(cfg, src, seed=10)
    convert(src, out, "tiny", expert_dir=str(tmp_path / "experts"))
    model = peft.PeftModel.from_pretrained(hf_model(tiny_model_dir("qwen3_moe")), str(out))
    n = 0
    for k, t in _expected(tensors).items():
        if ".experts." in k:
            continue
        mod = model.base_model.model.get_submodule(k.split(".lora_")[0])
        ab = "lora_A" if ".lora_A." in k else "lora_B"
        assert torch.equal(getattr(mod, ab)["default"].weight, t), k
        n += 1
    assert n == cfg.num_hidden_layers * 8


def test_overwrite(cfg, tmp_path):
    src, out = tmp_path / "sft", tmp_path / "out"
    kt_sft_dir(cfg, src, seed=4, alpha=8)
    assert _run(src, out, "--base-model-name-or-path", "a") == 0
    kt_sft_dir(cfg, src, seed=5, alpha=4)
    assert _run(src, out, "--base-model-name-or-path", "b") == 2  # exists
    assert _read(out)[1]["base_model_name_or_path"] == "a"
    assert _run(src, out, "--base-model-name-or-path", "b", "--overwrite") == 0
    got, conf = _read(out)
    assert conf["base_model_name_or_path"] == "b" and conf["lora_alpha"] == 4
    assert torch.equal(got["model.layers.0.mlp.experts.3.up_proj.lora_B.weight"],
                       load_file(str(src / "fused_expert_lora.safetensors"))["layers.0.experts.up_lora_b"][3])


def test_streams_tensor_by_tensor(cfg, tmp_path, monkeypatch):
    """Each input tensor is read and written once, on its own (never the whole adapter in memory)."""
    src = tmp_path / "sft"
    tensors = kt_sft_dir(cfg, src, seed=6)
    sizes: list[int] = []
    real = StreamWriter.write
    monkeypatch.setattr(StreamWriter, "write", lambda self, t: (sizes.append(t.nbytes), real(self, t))[1])
    monkeypatch.setattr("safetensors.torch.save_file", None)  # the non-streaming writer is not used
    convert(src, tmp_path / "out", "tiny")
    assert len(sizes) == len(tensors) and max(sizes) == max(t.nbytes for t in tensors.values())


# ---- malformed inputs: (mutation of a valid SFT dir, the error's words) -------------------------------
def _edit(file: str, fn):
    def go(src: Path) -> None:
        t = load_file(str(src / file))
        fn(t)
        save_file({k: v.clone() for k, v in t.items()}, str(src / file))  # clone: no shared storage
    return go


def _config(text: str):
    return lambda src: (src / "adapter_config.json").write_text(text)


def _cfg_update(**kw):
    def go(src: Path) -> None:
        c = json.loads((src / "adapter_config.json").read_text())
        c.update(kw)
        c = {k: v for k, v in c.items() if v is not None}
        (src / "adapter_config.json").write_text(json.dumps(c))
    return go


F, W = "fused_expert_lora.safetensors", "adapter_model.safetensors"
A0 = "base_model.model.model.layers.0.self_attn.q_proj"
BAD = {
    "wrong_key": (_edit(F, lambda t: t.update({"layers.0.experts.gate_lora_c": t["layers.0.experts.gate_lora_a"]})),
                  f"{F}: unexpected key 'layers.0.experts.gate_lora_c'"),
    "mlp_key": (_edit(F, lambda t: t.update({"layers.0.mlp.experts.gate_lora_a": t["layers.0.experts.gate_lora_a"]})),
                "unexpected key 'layers.0.mlp.experts.gate_lora_a'"),
    "not_3d": (_edit(F, lambda t: t.update({"layers.2.experts.up_lora_a": t["layers.2.experts.up_lora_a"][0]})),
               "layers.2.experts.up_lora_a has shape [4, 72]; expected a 3-D tensor"),
    "E_mismatch": (_edit(F, lambda t: t.update({"layers.2.experts.down_lora_b": t["layers.2.experts.down_lora_b"][1:]})),
                   "layers.2.experts.down_lora_b has shape [9, 72, 4]: experts (dim 0) 9, but"),
    "r_mismatch": (_edit(F, lambda t: t.update({"layers.2.experts.gate_lora_b": torch.zeros(10, 40, 5)})),
                   "layers.2.experts.gate_lora_b has shape [10, 40, 5]: rank 5, but"),
    "H_mismatch": (_edit(F, lambda t: t.update({"layers.2.experts.up_lora_a": torch.zeros(10, 4, 71)})),
                   "layers.2.experts.up_lora_a has shape [10, 4, 71]: hidden size 71, but layers.0.experts"),
    "missing_tensor": (_edit(F, lambda t: t.pop("layers.2.experts.down_lora_b")),
                       "layer 2 has no layers.2.experts.down_lora_b"),
    "empty_fused": (lambda s: save_file({}, str(s / F)), f"{F}: no tensors"),
    "corrupt_fused": (lambda s: (s / F).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json"),
                      f"{F}: not a readable safetensors file"),
    "no_fused": (lambda s: (s / F).unlink(), f"no {F} (required"),
    "nonexpert_rank": (_edit(W, lambda t: t.update({f"{A0}.lora_A.weight": torch.zeros(5, 72),
                                                    f"{A0}.lora_B.weight": torch.zeros(96, 5)})),
                       f"{A0}.lora_A.weight has shape [5, 72]: rank 5, but the experts' rank"),
    "config_r": (_cfg_update(r=8), "adapter_config.json: r 8 is not the experts' rank 4"),
    "nonexpert_3d": (_edit(W, lambda t: t.update({f"{A0}.lora_A.weight": torch.zeros(1, 4, 72)})), "expected 2-D"),
    "nonexpert_key": (_edit(W, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 72)})),
                      "'base_model.model.lm_head.lora_A.weight' is not a LoRA weight of a layer's linear"),
    "no_partner": (_edit(W, lambda t: t.pop(f"{A0}.lora_B.weight")), f"{A0}.lora_A.weight has no lora_B partner"),
    "duplicate": (_edit(W, lambda t: t.update({f"{A0}.orig_module.lora_A.weight": t[f"{A0}.lora_A.weight"]})),
                  "duplicate key"),
    "duplicate_expert": (_edit(W, lambda t: t.update({"model.layers.0.mlp.experts.1.up_proj.lora_A.weight":
                                                      torch.zeros(4, 72)})),
                         "is model.layers.0.mlp.experts.1.up_proj.lora_A.weight, which fused_expert_lora.safetensors"),
    "no_alpha": (_cfg_update(lora_alpha=None), "no lora_alpha (adapter_config.json has none); pass --lora-alpha"),
    "no_config_no_alpha": (lambda s: (s / "adapter_config.json").unlink(), "adapter_config.json absent"),
    "bad_json": (_config("{r: 4"), "adapter_config.json: not valid JSON"),
    "json_list": (_config("[4]"), "adapter_config.json: expected a JSON object"),
    "bad_alpha": (_cfg_update(lora_alpha="16"), "lora_alpha '16': expected a positive number"),
    "bad_r": (_cfg_update(r=0), "r 0: expected a positive integer"),
    "bad_targets": (_cfg_update(target_modules="all-linear"), "target_modules 'all-linear': expected a list"),
    "dora": (_cfg_update(use_dora=True), "use_dora is not supported"),
    # found while streaming (a diverged training run): still one line, and no output directory left behind
    "nan_expert": (_edit(F, lambda t: t["layers.2.experts.up_lora_b"].view(-1).__setitem__(5, float("nan"))),
                   f"{F}: layers.2.experts.up_lora_b holds NaN or infinite values (did the training diverge?)"),
    "inf_nonexpert": (_edit(W, lambda t: t[f"{A0}.lora_B.weight"].view(-1).__setitem__(0, float("-inf"))),
                      f"{W}: {A0}.lora_B.weight holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_input(cfg, tmp_path, capsys, case):
    src, out = tmp_path / "sft", tmp_path / "out"
    kt_sft_dir(cfg, src, seed=7)
    mutate, words = BAD[case]
    mutate(src)
    assert _run(src, out, "--base-model-name-or-path", "tiny") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hybridmoe convert-lora: error: "), err
    assert words in err, err
    assert not out.exists()


def _rc(*args) -> int:
    """The exit code, also of argparse's usage errors (which exit)."""
    try:
        return _run(*args)
    except SystemExit as e:
        return e.code


def _bad_options(src: Path, out: Path, tmp: Path) -> dict[str, tuple[list, str]]:
    base = ["--base-model-name-or-path", "tiny"]
    return {
        "not_a_dir": ([src / F, out, *base], "not a directory"),
        "inside_input": ([src, src / "conv", *base], "inside the input directory"),
        "is_input": ([src, src, "--overwrite", *base], "inside the input directory"),
        "output_is_file": ([src, tmp / "f", *base], "exists and is not a directory"),
        "split_same_as_output": ([src, out, "--expert-output-dir", out, *base], "the same directory as OUTPUT"),
        "split_without_nonexpert": ([src, out, "--expert-output-dir", tmp / "e", *base],
                                    "no non-expert tensors (adapter_model.safetensors), so OUTPUT would be empty"),
        "both_split_flags": ([src, out, "--expert-output-dir", tmp / "e", "--nonexpert-output-dir", tmp / "n", *base],
                             "not allowed with argument"),
        "no_base_model": ([src, out], "the following arguments are required: --base-model-name-or-path"),
        "empty_base_model": ([src, out, "--base-model-name-or-path", ""], "--base-model-name-or-path: expected"),
        "bad_alpha_flag": ([src, out, "--lora-alpha", "x", *base], "--lora-alpha: expected a number"),
        "negative_alpha_flag": ([src, out, "--lora-alpha", "-1", *base], "--lora-alpha -1: expected a positive"),
    }


BAD_OPTIONS = list(_bad_options(Path(), Path(), Path()))


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_options(cfg, tmp_path, capsys, case):
    src, out = tmp_path / "sft", tmp_path / "out"
    kt_sft_dir(cfg, src, seed=8, nonexpert=case != "split_without_nonexpert",
               alpha=None if case == "negative_alpha_flag" else 8)
    (tmp_path / "f").write_text("")
    args, words = _bad_options(src, out, tmp_path)[case]
    assert _rc(*args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert not out.exists() and not (tmp_path / "e").exists() and not (src / "conv").exists()


def test_exit_code_from_the_command_line(cfg, tmp_path):
    """`python -m hybridmoe.cli convert-lora` (the `hybridmoe` script's entry) and `python -m
    hybridmoe.convert_lora`: exit code 2 and one line for a malformed input; 0 and a loadable output."""
    src = tmp_path / "sft"
    kt_sft_dir(cfg, src, seed=9, alpha=None)
    for mod in ("hybridmoe.cli convert-lora", "hybridmoe.convert_lora"):
        dest = tmp_path / mod.replace(" ", "_")
        cmd = [sys.executable, "-m", *mod.split(), str(src), str(dest), "--base-model-name-or-path", "t"]
        bad = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
        assert "no lora_alpha" in bad.stderr
        ok = subprocess.run([*cmd, "--lora-alpha", "2.5"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert _read(dest)[1]["lora_alpha"] == 2.5


def test_api_error_type(cfg, tmp_path):
    with pytest.raises(ConvertLoRAError, match="not a directory"):
        convert(tmp_path / "missing", tmp_path / "out", "tiny")


# ---- the streaming safetensors writer against safetensors' reader ---------------------------------------
@pytest.mark.parametrize("shapes", [[(3, 5), (1,), (2, 1, 7)], [(0, 4), (1, 1)], []], ids=["odd", "empty_dim", "none"])
def test_stream_writer_round_trip(tmp_path, shapes):
    g = torch.Generator().manual_seed(0)
    dts = [torch.bfloat16, torch.float32, torch.float16, torch.int8]
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int8: "I8"}
    ts = {f"t{n}": (torch.randn(s, generator=g) * 50).to(dts[n % 4]) for n, s in enumerate(shapes)}
    path = tmp_path / "x.safetensors"
    with StreamWriter(path, [Entry(k, names[t.dtype], tuple(t.shape)) for k, t in ts.items()], {"format": "pt"}) as w:
        for t in ts.values():
            w.write(t)
    back = load_file(str(path))
    assert sorted(back) == sorted(ts) and all(torch.equal(back[k], t) and back[k].dtype == t.dtype
                                              for k, t in ts.items())
    # one stacked [2, 3] tensor as two [3] entries
    stacked = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with StreamWriter(path, [Entry("a", "F32", (3,)), Entry("b", "F32", (3,))]) as w:
        w.write(stacked)
    back = load_file(str(path))
    assert torch.equal(back["a"], stacked[0]) and torch.equal(back["b"], stacked[1])


def test_stream_writer_short_write_leaves_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="wrote 4 tensor bytes, the header plans 8"):
        with StreamWriter(path, [Entry("a", "F32", (2,))]) as w:
            w.write(torch.zeros(1))
    with pytest.raises(ValueError, match="more tensor bytes"):
        with StreamWriter(path, [Entry("a", "F32", (1,))]) as w:
            w.write(torch.zeros(2))
    assert list(tmp_path.iterdir()) == []
