"""Startup validation of `serve`, `generate` and `convert`: a bad config.json, tokenizer, shard or flag
is one line on stderr naming the file, tensor or flag, exit code 2, no traceback (--log-level debug
shows it), and `serve` never gets to listening. Most cases call the entry points in this process;
a few representative ones run as real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmoe.cli import main as cli_main
from hybridmoe.launch_server import serve_main

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hybridmoe" / "demo_model"
pytestmark = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="the demo model is not built")


@pytest.fixture(autouse=True)
def never_start(monkeypatch):
    """A bad case must fail before the server binds or the model loads: both are made test failures."""
    def started(*a, **k):
        raise AssertionError("STARTED: the checks let a bad case through")

    monkeypatch.setattr("hybridmoe.server.run.run_server", started)
    monkeypatch.setattr("hybridmoe.engine.llm.LLM", started)


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of `hybridmoe ARGV` in this process."""
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    return rc, capsys.readouterr().err.splitlines()


def _cmd(which: str, model: Path, out: Path) -> list[str]:
    if which == "convert":
        return ["convert", "--input-path", str(model), "--output", str(out), "--quant-method", "int8", "--no-progress"]
    return [which, "--device", "cpu", "--model-path", str(model)] + (["--port", "0"] if which == "serve" else [])


def _one_error_line(rc: int, lines: list[str], *want: str) -> str:
    assert rc == 2, lines
    assert len(lines) == 1, lines  # one line: no traceback, no usage block
    assert lines[0].startswith("hybridmoe ") and ": error: " in lines[0] and "Traceback" not in lines[0]
    for w in want:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _demo_copy(root: Path) -> Path:
    path = root / "model"
    shutil.copytree(DEMO, path)
    return path


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _break(kind: str, path: Path) -> str:
    """Damage the model copy at `path` one way; the text the error must contain."""
    if kind == "top_k_above_experts":
        _edit_config(path, num_experts_per_tok=16)
        return "num_experts_per_tok 16 is above num_experts 8"
    if kind == "kv_heads_not_dividing":
        _edit_config(path, num_key_value_heads=3)
        return "config.json: num_key_value_heads is 3, expected a divisor of num_attention_heads (4)"
    if kind == "zero_hidden":
        _edit_config(path, hidden_size=0)
        return "config.json: hidden_size is 0, expected an integer >= 1"
    if kind == "float_experts":  # refused by transformers' own validation, reported as one line
        _edit_config(path, num_experts=8.5)
        return "config.json: cannot be read: Validation error for field 'num_experts'"
    if kind == "negative_moe_size":
        _edit_config(path, moe_intermediate_size=-4)
        return "config.json: moe_intermediate_size is -4, expected an integer >= 1"
    if kind == "groups":
        _edit_config(path, n_group=3, topk_group=1)
        return "config.json: n_group is 3, expected a divisor of num_experts (8)"
    if kind == "experts_alias_a_list":  # an alias transformers does not type-check; was "TypeError: '>' not supported"
        _edit_config(path, num_local_experts=[])
        return "config.json: num_local_experts is [], expected an integer"
    if kind == "config_not_json":
        (path / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"],')
        return "config.json: not valid JSON"
    if kind == "eos_outside_vocab":
        _edit_config(path, eos_token_id=5000)
        return "config.json: eos_token_id is 5000, expected token id(s) in [0, 4096)"
    if kind == "truncated_shard":
        f = path / "model.safetensors"
        os.truncate(f, f.stat().st_size - 1000)
        return "model.safetensors: tensor 'model."
    if kind == "wrong_shape":
        from safetensors.torch import load_file, save_file

        t = load_file(str(path / "model.safetensors"))
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        t[name] = t[name][:, :7].contiguous()
        save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
        return "tensor 'model.layers.1.mlp.experts.3.down_proj.weight' has shape (128, 7), expected (128, 256)"
    if kind == "tokenizer_not_json":
        (path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
        return "tokenizer.json: not valid JSON"
    if kind == "tokenizer_bad_model":
        tok = json.loads((path / "tokenizer.json").read_text())
        tok["model"]["type"] = "NoSuchModel"
        (path / "tokenizer.json").write_text(json.dumps(tok))
        return "tokenizer.json: not a valid tokenizer"
    raise AssertionError(kind)


MODEL_CASES = ["top_k_above_experts", "kv_heads_not_dividing", "zero_hidden", "float_experts", "negative_moe_size",
               "groups", "experts_alias_a_list",
               "config_not_json", "eos_outside_vocab", "truncated_shard", "wrong_shape", "tokenizer_not_json",
               "tokenizer_bad_model"]
CONVERT_CASES = [c for c in MODEL_CASES if not c.startswith(("tokenizer", "eos"))]  # convert reads no tokenizer


@pytest.mark.parametrize("which", ["serve", "generate"])
@pytest.mark.parametrize("kind", MODEL_CASES)
def test_bad_model_serve_generate(which, kind, tmp_path, capsys):
    model = _demo_copy(tmp_path)
    want = _break(kind, model)
    _one_error_line(*_run(_cmd(which, model, tmp_path / "out"), capsys), f"hybridmoe {which}: error: ", want)


@pytest.mark.parametrize("kind", CONVERT_CASES)
def test_bad_model_convert(kind, tmp_path, capsys):
    model = _demo_copy(tmp_path)
    want = _break(kind, model)
    _one_error_line(*_run(_cmd("convert", model, tmp_path / "out"), capsys), "hybridmoe convert: error: ", want)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_convert_warns_about_a_broken_tokenizer(tmp_path, capsys, caplog):
    model = _demo_copy(tmp_path)
    _break("tokenizer_not_json", model)
    rc, _ = _run(_cmd("convert", model, tmp_path / "out"), capsys)
    assert rc == 0  # the experts do not need it
    assert "tokenizer.json: not valid JSON" in caplog.text and "serving this checkpoint will fail" in caplog.text


ENGINE_FLAGS = [
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens: got 0"),
    (["--max-prefill-tokens", "x"], "argument --max-prefill-tokens: invalid int value"),
    (["--max-prefill-tokens", "99999999999999999999"], "--max-prefill-tokens: got 99999999999999999999"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size: got 0"),
    (["--chunked-prefill-size", "-7"], "--chunked-prefill-size: got -7"),
    (["--context-length", "0"], "--context-length: got 0"),
    (["--context-length", "100000"], "--context-length: got 100000, expected at most the model's "
                                     "max_position_embeddings 2048"),
    (["--page-size", "0"], "--page-size: got 0"),
    (["--max-running-requests", "0"], "--max-running-requests: got 0"),
    (["--max-total-tokens", "8"], "--max-total-tokens: got 8, expected a positive integer, at least --page-size"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static: got 1.5"),
    (["--mem-fraction-static", "nan"], "--mem-fraction-static: got nan"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs: got 0"),
    (["--random-seed", "-1"], "--random-seed: got -1"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--kt-cpuinfer", "0"], "--kt-cpuinfer: got 0"),
    (["--kt-threadpool-count", "0"], "--kt-threadpool-count: got 0"),
    (["--kt-num-gpu-experts", "-1"], "--kt-num-gpu-experts: got -1"),
    (["--kt-gpu-experts-ratio", "2"], "--kt-gpu-experts-ratio: got 2.0"),
    (["--kt-max-deferred-experts-per-token", "-1"], "--kt-max-deferred-experts-per-token: got -1"),
    (["--kt-gpu-prefill-token-threshold", "0"], "--kt-gpu-prefill-token-threshold: got 0"),
    (["--kt-numa-nodes", "99"], "--kt-numa-nodes: got '99'"),
    (["--kt-numa-nodes", "zero"], "--kt-numa-nodes: got 'zero'"),
    (["--kt-expert-placement-strategy", "frequency"], "--init-expert-location FILE"),
    (["--init-expert-location", "/no/such/stats.json"], "--init-expert-location /no/such/stats.json: no such file"),
    (["--kt-num-gpu-experts", "2", "--kt-expert-placement-strategy", "frequency", "--init-expert-location", "trivial"],
     "--init-expert-location FILE with 'frequency' (the statistics file; 'trivial' holds none"),
    (["--kt-num-gpu-experts", "2", "--kt-expert-placement-strategy", "frequency", "--init-expert-location",
      '{"logical_count": [[1]]}'], "--init-expert-location <inline JSON>: 'logical_count' has shape [1, 1]"),
    (["--kt-weight-path", "/no/such/dir"], "--kt-weight-path /no/such/dir: no such directory"),
    (["--tokenizer-path", "/no/such/tok"], "--tokenizer-path /no/such/tok: no such directory"),
    (["--record-expert-distribution", "/no/such/dir/stats.json"], "--record-expert-distribution"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # adapters are checked before the model loads (a missing one was found after the whole load)
    (["--lora-paths", "a=/no/such/adapter"], "--lora-paths: LoRA adapter '/no/such/adapter': not a directory"),
    (["--lora-paths", str(DEMO)], f"--lora-paths: LoRA adapter '{DEMO}': no adapter_config.json"),
    (["--lora-paths", "=x"], "--lora-paths '=x': expected name=path or a path"),
    (["--kt-expert-lora-path", "/no/such/dir"], "--kt-expert-lora-path: LoRA adapter '/no/such/dir': not a directory"),
]
SERVE_FLAGS = [
    (["--graceful-shutdown-timeout", "-5"], "--graceful-shutdown-timeout: got -5.0"),
    (["--graceful-shutdown-timeout", "inf"], "--graceful-shutdown-timeout: got inf"),
    (["--max-queued-requests", "-1"], "--max-queued-requests: got -1"),
    (["--port", "70000"], "--port: got 70000"),
]
GENERATE_FLAGS = [
    (["--max-new-tokens", "0"], "--max-new-tokens: got 0"),
    (["--temperature", "-1"], "--temperature: got -1.0"),
    (["--top-p", "0"], "--top-p: got 0.0"),
    (["--seed", "-3"], "--seed: got -3"),
]
CONVERT_FLAGS = [
    (["--threads", "0"], "--threads: got 0"),
    (["--quant-method", "int3"], "argument --quant-method: invalid choice: 'int3'"),
    (["--input-type", "fp32"], "argument --input-type: invalid choice: 'fp32'"),
    (["--quant-method", "int4", "--group-size", "48"], "--group-size 48: int4 groups must be one of"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["--verify", "/no/such/dir"], "--verify /no/such/dir: no such directory"),
]


@pytest.mark.parametrize("which", ["serve", "generate"])
@pytest.mark.parametrize(("flags", "want"), ENGINE_FLAGS)
def test_bad_engine_flag(which, flags, want, capsys):
    _one_error_line(*_run(_cmd(which, DEMO, Path("/unused")) + flags, capsys), f"hybridmoe {which}: error: ", want)


@pytest.mark.parametrize(("which", "flags", "want"), [("serve", *c) for c in SERVE_FLAGS]
                         + [("generate", *c) for c in GENERATE_FLAGS] + [("convert", *c) for c in CONVERT_FLAGS])
def test_bad_command_flag(which, flags, want, tmp_path, capsys):
    _one_error_line(*_run(_cmd(which, DEMO, tmp_path / "out") + flags, capsys), f"hybridmoe {which}: error: ", want)


def test_convert_missing_flag_is_one_line(capsys):
    _one_error_line(*_run(["convert", "--input-path", str(DEMO)], capsys), "--output", "--quant-method")


@pytest.mark.parametrize("which", ["serve", "generate", "convert"])
def test_debug_log_level_shows_the_traceback(which, tmp_path, capsys):
    model = _demo_copy(tmp_path)
    want = _break("top_k_above_experts", model)
    rc, lines = _run(_cmd(which, model, tmp_path / "out") + ["--log-level", "debug"], capsys)
    assert rc == 2 and lines[0] == "Traceback (most recent call last):" and len(lines) > 5
    assert lines[-1].startswith(f"hybridmoe {which}: error: ") and want in lines[-1]


@pytest.mark.parametrize(("which", "kind"), [("generate", "top_k_above_experts"), ("serve", "tokenizer_bad_model"),
                                             ("convert", "truncated_shard")])
def test_as_a_process(which, kind, tmp_path):
    """The real command line: exit code 2 and exactly one line on stderr (nothing else printed)."""
    model = _demo_copy(tmp_path)
    want = _break(kind, model)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "hybridmoe.cli", *_cmd(which, model, tmp_path / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=env)
    _one_error_line(r.returncode, r.stderr.splitlines(), f"hybridmoe {which}: error: ", want)
    assert r.stdout == ""


@pytest.mark.parametrize("level", ["info", "debug"])
def test_serve_load_failure_after_start_exits_2(level, monkeypatch, capsys, caplog):
    """A failure while the engine thread loads (after the server started): exit code 2, one ERROR line
    naming the file; its traceback only with --log-level debug."""
    from hybridmoe.weights.loader import CheckpointError

    monkeypatch.undo()  # this one starts the server

    def failing_engine(args, progress=True):
        raise CheckpointError(f"{args.model_path}/model.safetensors: tensor 'x' cannot be read: boom")

    monkeypatch.setattr("hybridmoe.server.async_engine.Engine", failing_engine)
    caplog.set_level(level.upper())  # what serve's logging.basicConfig does in a process of its own
    assert serve_main(["--device", "cpu", "--port", "0", "--log-level", level]) == 2
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "model.safetensors: tensor 'x' cannot be read: boom" in errors[0].getMessage()
    assert bool(errors[0].exc_info) == (level == "debug")
    assert "Traceback" not in capsys.readouterr().err or level == "debug"


# ---- oversubscription: lowered to what there is, one warning each -------------------------------
def _demo_config():
    from hybridmoe.model_check import load_checked_config

    return load_checked_config(str(DEMO))[0]


def test_oversubscribed_cpu_options_are_lowered_with_a_warning():
    from hybridmoe.config import EngineArgs
    from hybridmoe.cpu.topology import numa_nodes
    from hybridmoe.startup import cpuinfer_oversubscription, gpu_experts_oversubscription, threadpool_oversubscription

    cfg = _demo_config()
    cores, nodes = len(os.sched_getaffinity(0)), len(numa_nodes())
    args = EngineArgs(kt_cpuinfer=cores + 62, kt_threadpool_count=nodes + 3, kt_num_gpu_experts=32)
    lowered, msg = cpuinfer_oversubscription(args, cfg)
    assert lowered.kt_cpuinfer == cores and msg is not None
    assert msg.startswith(f"--kt-cpuinfer {cores + 62} is above the {cores} CPU core(s)") and f"using {cores}" in msg
    lowered, msg = threadpool_oversubscription(args, cfg)
    assert lowered.kt_threadpool_count == nodes and f"--kt-threadpool-count {nodes + 3} is above the {nodes}" in msg
    assert f"using {nodes} sub-pool(s)" in msg
    lowered, msg = gpu_experts_oversubscription(args, cfg)
    assert lowered.kt_num_gpu_experts == 8 and msg is not None
    assert "--kt-num-gpu-experts 32 is above the 8 routed experts per MoE layer" in msg and "using 8" in msg
    fits = EngineArgs(kt_cpuinfer=cores, kt_threadpool_count=nodes, kt_num_gpu_experts=8)
    for check in (cpuinfer_oversubscription, threadpool_oversubscription, gpu_experts_oversubscription):
        assert check(fits, cfg) == (fits, None)


def test_startup_logs_each_oversubscription_once(caplog):
    from hybridmoe.config import EngineArgs
    from hybridmoe.startup import prepare

    cores = len(os.sched_getaffinity(0))
    args = prepare(EngineArgs.from_kwargs(device="cpu", kt_cpuinfer=cores + 1, kt_num_gpu_experts=9))
    assert (args.kt_cpuinfer, args.kt_num_gpu_experts) == (cores, 8)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert warnings[0].startswith(f"--kt-cpuinfer {cores + 1} is above") and warnings[1].startswith(
        "--kt-num-gpu-experts 9 is above")
