"""Hostile flags, files and environment variables of the command line (an audit of every sub-command): each is one
`hybridmoe <cmd>: error: ...` line on stderr naming the flag, file or variable, exit code 2, before the server
listens or the model loads; never a traceback, a usage block, a hang or a giant allocation. The cases are the ones
the audit found wrong; tests/test_startup_validation.py, tests/server/test_flags.py and tests/server/test_limits.py
hold the rest."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from hybridmoe.check import check_main
from hybridmoe.cli import main as cli_main
from hybridmoe.config import ConfigError, EngineArgs
from hybridmoe.launch_server import serve_main
from hybridmoe.server.limits import ServerLimits

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hybridmoe" / "demo_model"
pytestmark = [pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="the demo model is not built"),
              pytest.mark.timeout(60)]
SERVE = ["serve", "--device", "cpu", "--port", "0"]
GENERATE = ["generate", "--device", "cpu"]


@pytest.fixture
def never_start(monkeypatch):
    """A refused case must not get to the server or the model load: both are made test failures."""
    def started(*a: object, **k: object) -> None:
        raise AssertionError("STARTED: the checks let a bad case through")

    class Started:
        __init__ = started
        from_prepared = staticmethod(started)

    monkeypatch.setattr("hybridmoe.server.run.run_server", started)
    monkeypatch.setattr("hybridmoe.engine.llm.LLM", Started)


def _run(main, argv: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    return rc, capsys.readouterr().err.splitlines()


def _one_line(rc: int, lines: list[str], prog: str, *want: str) -> str:
    assert rc == 2 and len(lines) == 1, (rc, lines)
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in lines[0], lines
    for w in want:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---- hybridmoe check: a one-line parser, and its sizing flags checked ------------------------------------------
@pytest.mark.parametrize(("argv", "want"), [
    (["--bogus"], "unrecognized arguments: --bogus"),  # was argparse's usage block, then the error
    (["--model", str(DEMO), "--gpu-memory-gib", "inf"], "--gpu-memory-gib: got inf"),  # was an OverflowError traceback
    (["--model", str(DEMO), "--gpu-memory-gib", "nan"], "--gpu-memory-gib: got nan"),  # named no flag
    (["--model", str(DEMO), "--gpu-memory-gib", "-24"], "--gpu-memory-gib: got -24.0"),  # sized nonsense, exit 0
    (["--model", str(DEMO), "--context-length", "-5"], "--context-length: got -5"),
    (["--model", str(DEMO), "--context-length", "100000"], "expected at most the model's max_position_embeddings"),
    (["--model", str(DEMO), "--mem-fraction-static", "1.5"], "--mem-fraction-static: got 1.5"),
    (["--model", str(DEMO), "--max-total-tokens", "0"], "--max-total-tokens: got 0"),
    (["--model", str(DEMO), "--kt-method", "garbage"], "argument --kt-method: 'garbage' is not a CPU expert method; accepted: AMXINT8"),
    (["--gpu-memory-gib", "24"], "--gpu-memory-gib: sizes the experts of --model"),  # was ignored without --model
    (["--model", ""], "--model: got ''"),
    (["--model", "/no/such\nmodel"], "--model /no/such model: no such directory"),  # was two lines
], ids=["unknown_flag", "gpu_inf", "gpu_nan", "gpu_negative", "context_negative", "context_above_model",
        "fraction", "kv_zero", "method", "sizing_flag_without_model", "model_empty", "model_newline"])
def test_check_flag_errors_are_one_line(argv, want, capsys):
    _one_line(*_run(check_main, argv, capsys), "hybridmoe check", want)


# ---- serve's limit flags ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "want"), [
    (["--max-request-body-size", "inf"], "argument --max-request-body-size: expected a size"),  # was a traceback
    (["--max-request-body-size", "1e309"], "argument --max-request-body-size: expected a size"),
    # multiprocessing's poll overflows past ~24.8 days: every large tokenize job failed, not the startup
    (["--tokenize-timeout", "3000000"], "--tokenize-timeout: got 3000000.0, expected a number of seconds in (0, 86400]"),
    (["--header-timeout", str(2**63)], "--header-timeout: got 9.223372036854776e+18"),
    (["--tokenizer-workers", "100000"], "--tokenizer-workers: got 100000, expected an integer in [1, 64]"),
    (["--max-connections", "1" + "0" * 400], "--max-connections: got 1000"),  # was an OverflowError naming no flag
], ids=["body_inf", "body_1e309", "timeout_past_poll", "timeout_2e63", "workers", "connections_400_digits"])
def test_limit_flags_out_of_range(argv, want, capsys, never_start):
    line = _one_line(*_run(serve_main, ["--device", "cpu", "--port", "0", *argv], capsys), "hybridmoe serve", want)
    assert "LimitsError" not in line  # reported as the other flag errors, without the class name


def test_limits_error_is_a_config_error():
    with pytest.raises(ConfigError, match="--chat-template-timeout"):
        ServerLimits(chat_template_timeout=1e9)


# ---- serve: the address -----------------------------------------------------------------------------------------
def test_port_in_use_is_one_error_line(capsys):
    """It was a log line of another format ("... ERROR hybridmoe.server.run: cannot listen on ..."), after the app
    was built; now the bind comes first and fails as a flag error. Nothing loads the model here."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, lines = _run(serve_main, ["--device", "cpu", "--port", str(port)], capsys)
    _one_line(rc, lines, "hybridmoe serve", f"--host 127.0.0.1 --port {port}: cannot listen there: Address already in use")


@pytest.mark.parametrize(("flag", "value"), [("--host", "127.0.0.1\nx"), ("--host", "a b"),
                                             ("--api-key", "secret "), ("--api-key", "se\ncret")])
def test_host_and_api_key_that_cannot_work(flag, value, capsys, never_start):
    """A newline in --host split the bind error in two; an API key no header can carry made every request a 401."""
    line = _one_line(*_run(cli_main, [*SERVE, flag, value], capsys), "hybridmoe serve", f"{flag}: ")
    if flag == "--api-key":
        assert "cret" not in line  # a secret is not echoed
    else:
        assert f"got {value!r}" in line


# ---- engine flags ---------------------------------------------------------------------------------------------
def test_huge_numa_node_range_is_refused_before_it_is_expanded():
    """"0-1000000000" was expanded node by node: gigabytes, then a MemoryError after ~10 s."""
    with pytest.raises(ConfigError, match="--kt-numa-nodes: got '0-2000000', expected NUMA node ids below 1024"):
        EngineArgs.from_kwargs(kt_numa_nodes="0-2000000")


@pytest.mark.parametrize(("kwargs", "want"), [
    ({"kt_expert_lora_path": ""}, "--kt-expert-lora-path: got ''"),  # was taken as no flag
    ({"enable_lora": True, "lora_target_modules": [""]}, "--lora-target-modules: got ['']"),  # LoRA on nothing
    ({"max_total_tokens": 16}, "--max-total-tokens: got 16, expected a positive integer, at least --page-size x 2"),
])
def test_engine_values_that_passed(kwargs, want):
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(**kwargs)
    assert want in str(e.value)


def test_cpu_kv_cache_larger_than_the_ram_is_refused_before_loading(capsys, never_start):
    """It was a 4 TiB allocation after the whole model load."""
    _one_line(*_run(cli_main, [*GENERATE, "--max-total-tokens", "2147483647"], capsys), "hybridmoe generate",
              "--max-total-tokens 2147483647: a KV cache of", "more than this machine's")


def test_generate_empty_prompt_is_refused_before_loading(capsys, never_start):
    """The engine refused it ("RequestError: the prompt is empty") after the whole model load."""
    _one_line(*_run(cli_main, [*GENERATE, "--prompt", ""], capsys), "hybridmoe generate", "--prompt: got ''")


# ---- files -------------------------------------------------------------------------------------------------------
def _demo_with(tmp_path: Path, name: str, make) -> Path:
    model = tmp_path / "m"
    model.mkdir()
    for f in DEMO.iterdir():
        if f.name != name:
            (model / f.name).symlink_to(f)
    make(model / name)
    return model


@pytest.mark.parametrize(("name", "make"), [("tokenizer.json", os.mkfifo),
                                            ("tokenizer.json", lambda p: p.symlink_to("/dev/zero")),
                                            ("special_tokens_map.json", os.mkfifo)],
                         ids=["tokenizer_fifo", "tokenizer_dev_zero", "special_tokens_fifo"])
def test_tokenizer_file_that_is_not_a_file(name, make, tmp_path, capsys, never_start):
    """The checks skipped what is not a regular file; the load then failed with transformers' "Couldn't
    instantiate the backend tokenizer", naming no file."""
    model = _demo_with(tmp_path, name, make)
    _one_line(*_run(cli_main, [*SERVE, "--model", str(model)], capsys), "hybridmoe serve",
              f"{model / name}: not a regular file")


def test_serve_tokenizer_path_without_a_tokenizer(tmp_path, capsys, never_start):
    """`serve` started without a tokenizer (every text request then a 400) when --tokenizer-path named a directory
    without one; `generate` already refused it."""
    _one_line(*_run(cli_main, [*SERVE, "--tokenizer-path", str(tmp_path)], capsys), "hybridmoe serve",
              f"--tokenizer-path {tmp_path}: no tokenizer files")


def test_record_expert_distribution_onto_a_device_is_refused(capsys, never_start):
    """The statistics file is renamed over the path at shutdown: as root, /dev/null itself was replaced."""
    _one_line(*_run(cli_main, [*SERVE, "--record-expert-distribution", "/dev/null"], capsys), "hybridmoe serve",
              "--record-expert-distribution /dev/null: exists and is not a regular file")


# ---- environment -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("var", "value"), [("HYBRIDMOE_CPU_ISA", "bogus"), ("HYBRIDMOE_CPU_LIB", "/dev/zero"),
                                            ("HYBRIDMOE_OVERLAP_SCHEDULE", "yes"), ("HYBRIDMOE_PIN_CALLER", "2"),
                                            ("HYBRIDMOE_HUGEPAGES", "off"), ("HYBRIDMOE_AMX_INLINE", "true"),
                                            ("HYBRIDMOE_LORA_FUSED", "no")])
def test_bad_environment_variable_is_named_before_loading(var, value, monkeypatch, capsys, never_start):
    """They were errors from inside the load naming no variable (CpuIsaError, OSError: invalid ELF header), or
    silently ignored (HYBRIDMOE_OVERLAP_SCHEDULE=yes; HYBRIDMOE_HUGEPAGES=off kept huge pages, AMX_INLINE=true
    stayed off, LORA_FUSED=no stayed fused)."""
    monkeypatch.setenv(var, value)
    _one_line(*_run(cli_main, GENERATE, capsys), "hybridmoe generate", f"${var}={value!r}")


# ---- convert -----------------------------------------------------------------------------------------------------
def test_convert_empty_output_is_refused_not_the_current_directory(tmp_path, monkeypatch, capsys):
    """Path('') is '.': an empty --output converted into the current directory."""
    monkeypatch.chdir(tmp_path)
    argv = ["convert", "--input-path", str(DEMO), "--output", "", "--quant-method", "int8", "--no-progress"]
    _one_line(*_run(cli_main, argv, capsys), "hybridmoe convert", "--output: got ''")
    assert list(tmp_path.iterdir()) == []


def test_convert_bad_delay_variable_is_named_before_writing(tmp_path, monkeypatch, capsys):
    from hybridmoe.convert import DELAY_ENV

    monkeypatch.setenv(DELAY_ENV, "inf")  # was "OverflowError: timestamp out of range" after a progress.json
    out = tmp_path / "out"
    argv = ["convert", "--input-path", str(DEMO), "--output", str(out), "--quant-method", "int8", "--no-progress"]
    _one_line(*_run(cli_main, argv, capsys), "hybridmoe convert", f"${DELAY_ENV}='inf'")
    assert not out.exists()


def test_the_accepted_values_still_pass(tmp_path, capsys, never_start):
    """The new bounds keep the values in use: limits at their edges, a day of timeout, node 0, two pages."""
    ServerLimits(tokenizer_workers=64, tokenize_timeout=86400.0, max_request_body_size=1 << 40)
    EngineArgs.from_kwargs(kt_numa_nodes="0", max_total_tokens=32, enable_lora=True, lora_target_modules=["all"])
    assert check_main(["--model", str(DEMO), "--json", "--kt-method", "amxint4", "--context-length", "64"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["recommended_flags"]["--kt-method"] == "AMXINT4"
