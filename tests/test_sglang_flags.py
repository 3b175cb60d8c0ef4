"""Every flag of SGLang's `launch_server` (sglang_flags.py's catalogue) through `hybridmoe serve`'s parser: each
is hybridmoe's own, accepted (single-device sizes, SGLang's default values, no-ops that log a line), or refused
with one line naming it (exit code 2); none is "unrecognized". Also KTransformers' older kt names, SGLang's other
names of our tool-call and reasoning formats, and --grammar-backend's values."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from hybridmoe.config import ConfigError, EngineArgs, ServerConfig
from hybridmoe.launch_server import build_parser, refusals, serve_main
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.parsers.reasoning import REASONING_FORMATS, ReasoningParser, starts_in_reasoning
from hybridmoe.sglang_compat import ignored
from hybridmoe.sglang_flags import (
    FLAGS,
    NO_OP,
    OURS,
    REASONING_PARSER_ALIASES,
    REFUSED,
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_CALL_PARSERS,
    SIZE,
    TOOL_CALL_PARSER_ALIASES,
    VALUE,
    SGLangFlag,
)

PARSER = build_parser()
# a valid value of our own flags whose values are checked while parsing
OUR_SAMPLES = {"--tool-call-parser": "qwen25", "--reasoning-parser": "qwen3", "--grammar-backend": "xgrammar",
               "--kt-method": "AMXINT8", "--kt-amx-method": "AMXINT8"}
SPELLINGS = [(flag, spelling) for flag in FLAGS for spelling in flag.names]


def _sample(flag: SGLangFlag, spelling: str) -> str:
    if flag.decision in (SIZE, VALUE):
        return flag.accepted[0]
    if flag.decision == OURS:
        if spelling in OUR_SAMPLES:
            return OUR_SAMPLES[spelling]
        choices = PARSER._option_string_actions[spelling].choices
        return str(next(iter(choices))) if choices else "1"
    return "1"


def _argv(flag: SGLangFlag, spelling: str) -> list[str]:
    """The flag as SGLang takes it: a switch alone, else with one value (two for a list)."""
    if flag.takes == "0":
        return [spelling]
    value = _sample(flag, spelling)
    return [spelling, value, value] if flag.takes == "+" else [spelling, value]


def _parse(argv: list[str]) -> argparse.Namespace:
    try:
        return PARSER.parse_args(argv)
    except SystemExit as e:  # would be "unrecognized arguments", "expected one argument", ...
        raise AssertionError(f"{argv}: the parser refused it (exit {e.code})") from None


@pytest.mark.parametrize("flag,spelling", SPELLINGS, ids=[s for _, s in SPELLINGS])
def test_every_sglang_flag_parses_and_is_honoured_accepted_or_refused_by_name(flag, spelling):
    argv = _argv(flag, spelling)
    ns = _parse(argv)
    bad = refusals(argv, ns)
    if flag.decision == REFUSED:
        assert bad == [f"{spelling}: {flag.reason}; remove the flag"]
    else:
        assert bad == [], (argv, bad)
    assert ignored(ns) == ([f"{spelling}: {flag.reason}"] if flag.decision == NO_OP else [])


@pytest.mark.parametrize("flag,spelling", SPELLINGS, ids=[s for _, s in SPELLINGS])
def test_a_flag_takes_no_more_values_than_sglangs(flag, spelling):
    """The token after the flag's own values is the next flag, not a stray value (nor swallowed)."""
    ns = _parse([*_argv(flag, spelling), "--port", "1234"])
    assert ns.port == 1234


def test_the_catalogue():
    spellings = [s for _, s in SPELLINGS]
    assert len(spellings) == len(set(spellings)) > 600
    assert set(spellings) <= set(PARSER._option_string_actions)
    assert all(f.takes in ("0", "1", "+", "*", "?") and f.decision in (OURS, SIZE, VALUE, NO_OP, REFUSED)
               for f in FLAGS)
    assert all(f.reason for f in FLAGS if f.decision != OURS)
    assert all(f.accepted for f in FLAGS if f.decision in (SIZE, VALUE))
    # an accepted or refused SGLang flag never reaches the engine's or the server's options
    ours = {f.name for cls in (EngineArgs, ServerConfig, ServerLimits) for f in dataclasses.fields(cls)}
    assert not {f.dest for f in FLAGS if f.decision in (NO_OP, VALUE, REFUSED)} & ours


@pytest.fixture
def never_start(monkeypatch):
    """serve_main up to the server, which is not started (nor the model loaded): 0 when nothing was refused."""
    monkeypatch.setattr("hybridmoe.startup.prepare", lambda args: args)
    monkeypatch.setattr("hybridmoe.server.run.run_server", lambda *a, **k: 0)


ACCEPTED_EXAMPLES = [["--sampling-backend", "flashinfer"], ["--tokenizer-mode", "auto"], ["--skip-server-warmup"],
                     ["--enable-dp-lm-head"], ["--show-time-cost"], ["--cpu-offload-gb", "0"], ["--base-gpu-id", "0"],
                     ["--disable-chunked-prefix-cache"], ["--enable-metrics-for-all-schedulers"],
                     ["--expert-distribution-recorder-mode", "stat"]]


@pytest.mark.parametrize("argv", ACCEPTED_EXAMPLES, ids=[a[0] for a in ACCEPTED_EXAMPLES])
def test_examples_that_are_accepted(argv, never_start, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="hybridmoe.sglang_compat"):
        assert serve_main(["--device", "cpu", *argv]) == 0
    assert capsys.readouterr().err == ""
    logged = [r.getMessage() for r in caplog.records if r.name == "hybridmoe.sglang_compat"]
    if len(argv) == 1 or argv[0] == "--sampling-backend":  # the no-ops say so; a default value is what we do
        assert len(logged) == 1 and logged[0].startswith(f"{argv[0]}: accepted")
    else:
        assert logged == []


REFUSED_EXAMPLES = [
    (["--stream-output"], "--stream-output: incremental (disjoint) stream output is not implemented"),
    (["--cpu-offload-gb", "8"], "--cpu-offload-gb 8: only 0 is accepted; SGLang's weight offloading is not "
                                "implemented"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: only auto is accepted"),
    (["--base-gpu-id", "1"], "--base-gpu-id 1: only 0 is accepted; the server runs on the first visible GPU: "
                             "choose it with CUDA_VISIBLE_DEVICES"),
    (["--expert-distribution-recorder-mode", "per_token"], "--expert-distribution-recorder-mode per_token: only "
                                                           "stat is accepted"),
    (["--attn-dp-size", "2"], "--attn-dp-size 2: only 1 is supported; data-parallel attention is not built"),
    (["--enable-hicache"], "--enable-hicache: KV-cache offload to host memory or storage is not implemented"),
    (["--speculative-draft-model", "d"], "--speculative-draft-model: speculative decoding is not built"),
    (["--ssl-certfile", "c.pem"], "--ssl-certfile: TLS is not implemented"),
    (["--enable-tf32-matmul"], "--enable-tf32-matmul: TF32 matmuls are not used"),
]


@pytest.mark.parametrize("argv,want", REFUSED_EXAMPLES, ids=[a[0][0] for a in REFUSED_EXAMPLES])
def test_examples_that_are_refused(argv, want, never_start, capsys):
    assert serve_main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"hybridmoe serve: error: {want}"), err
    assert "unrecognized" not in err[0]


def test_refusals_and_no_ops_together(never_start, capsys):
    assert serve_main(["--device", "cpu", "--show-time-cost", "--stream-output", "--enable-trace", "--tp-size",
                       "2", "--cpu-offload-gb", "0", "--log-level-http", "warning"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert sorted(line.split(": ")[2] for line in err) == ["--enable-trace", "--stream-output", "--tp-size 2"], err


def test_kt_older_names_are_aliases():
    ns = _parse(["--kt-amx-weight-path", "/w", "--kt-amx-method", "amxint4"])
    assert (ns.kt_weight_path, ns.kt_method) == ("/w", "AMXINT4")
    assert refusals([], ns) == []


@pytest.mark.parametrize("argv,nodes", [(["--kt-numa-nodes", "0", "1"], "0,1"), (["--kt-numa-nodes", "0,1"], "0,1"),
                                        (["--kt-numa-nodes", "0-3"], "0-3")])
def test_kt_numa_nodes_in_ktransformers_form_and_ours(argv, nodes):
    assert _parse(argv).kt_numa_nodes == nodes


def test_sglang_graph_names_that_are_ours():
    from hybridmoe.args import engine_args_from

    args = engine_args_from(_parse(["--cuda-graph-max-bs-decode", "24", "--disable-prefill-cuda-graph"]))
    assert (args.cuda_graph_max_bs, args.cuda_graph_max_prefill_tokens, args.disable_cuda_graph) == (24, 0, False)


def test_numbers_compare_as_numbers():
    for argv in (["--schedule-conservativeness", "1.0"], ["--lora-drain-wait-threshold", "0.0"]):
        assert refusals(argv, _parse(argv)) == []
    argv = ["--schedule-conservativeness", "0.3"]
    assert refusals(argv, _parse(argv))[0].startswith("--schedule-conservativeness 0.3: only 1 is accepted")


# ---- parser names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,given,ours", [
    ("--tool-call-parser", "qwen", "qwen25"), ("--tool-call-parser", "hermes", "qwen25"),
    ("--tool-call-parser", "kimi_k2", "kimi_k2"), ("--reasoning-parser", "deepseek-v3", "qwen3"),
    ("--reasoning-parser", "glm45", "qwen3"), ("--reasoning-parser", "minimax", "qwen3-thinking"),
    ("--reasoning-parser", "step3", "deepseek-r1"), ("--reasoning-parser", "qwen3-thinking", "qwen3-thinking")])
def test_sglangs_other_names_of_our_formats(flag, given, ours):
    ns = _parse([flag, given])
    assert getattr(ns, flag[2:].replace("-", "_")) == ours
    field = flag[2:].replace("-", "_")
    assert getattr(ServerConfig(**{field: given}), field) == ours


@pytest.mark.parametrize("flag,name,want", [
    ("--tool-call-parser", "qwen3_coder", "'qwen3_coder' is SGLang's parser for a tool-call format that hybridmoe "
                                          "does not implement; accepted: qwen25 (also qwen, hermes), deepseekv3, "
                                          "kimi_k2"),
    ("--tool-call-parser", "glm45", "'glm45' is SGLang's parser for a tool-call format"),
    ("--tool-call-parser", "llama3", "'llama3' is SGLang's parser for a tool-call format"),
    ("--tool-call-parser", "deepseekv31", "'deepseekv31' is SGLang's parser"),
    ("--tool-call-parser", "no-such", "'no-such' is not a tool-call parser; accepted: qwen25"),
    ("--reasoning-parser", "gpt-oss", "'gpt-oss' is SGLang's parser for a reasoning format that hybridmoe does not "
                                      "implement; accepted: qwen3 (also deepseek-v3, glm45"),
    ("--reasoning-parser", "no-such", "'no-such' is not a reasoning parser"),
])
def test_other_parser_names_are_refused_naming_the_value_and_what_is_accepted(flag, name, want, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([flag, name])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"hybridmoe serve: error: argument {flag}: {want}"), err
    assert "invalid choice" not in err
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        ServerConfig(**{flag[2:].replace("-", "_"): name})


def test_every_sglang_parser_name_is_accepted_or_refused_clearly():
    from hybridmoe.config import reasoning_parser_name, tool_call_parser_name

    for names, check, aliases in ((SGLANG_TOOL_CALL_PARSERS, tool_call_parser_name, TOOL_CALL_PARSER_ALIASES),
                                  (SGLANG_REASONING_PARSERS, reasoning_parser_name, REASONING_PARSER_ALIASES)):
        assert set(aliases) <= set(names)
        for name in names:
            try:
                check(name)
            except ConfigError as e:
                assert str(e).startswith(f"{name!r} is SGLang's parser for a "), e


# the qwen3-thinking format: qwen3's tags, the output starting inside the thinking part
QWEN3_THINKING = [
    ("The user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),
    ("<think>\nopened anyway</think>Four.", "opened anyway", "Four."),
    ("Let me call a tool.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "Let me call a tool.",
     "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
    ("cut short by max_tokens", "cut short by max_tokens", ""),
]


@pytest.mark.parametrize("text,reasoning,answer", QWEN3_THINKING)
def test_qwen3_thinking_starts_inside_the_thinking_part(text, reasoning, answer):
    fmt = REASONING_FORMATS["qwen3-thinking"]
    assert ReasoningParser(fmt).parse(text) == (reasoning, answer)
    parser, got = ReasoningParser(fmt), ("", "")
    for ch in text:  # one character at a time
        r, a = parser.feed(ch)
        got = (got[0] + r, got[1] + a)
    r, a = parser.finish()
    assert (got[0] + r, got[1] + a) == (reasoning, answer)
    assert starts_in_reasoning(fmt, "")
    # qwen3 (and its aliases) decide from the output or the prompt instead
    assert ReasoningParser(REASONING_FORMATS["qwen3"]).parse("Plain answer.") == ("", "Plain answer.")
    assert ReasoningParser(fmt).parse("Plain answer.") == ("Plain answer.", "")


def test_deepseek_v3s_thinking_toggle_is_read_from_the_prompt():
    fmt = REASONING_FORMATS[ServerConfig(reasoning_parser="deepseek-v3").reasoning_parser]
    # DeepSeek-V3.1's template ends the prompt with <think> (thinking on) or </think> (off)
    assert starts_in_reasoning(fmt, "<｜Assistant｜><think>")
    assert not starts_in_reasoning(fmt, "<｜Assistant｜></think>")
    assert ReasoningParser(fmt, in_reasoning=True).parse("why</think>because") == ("why", "because")
    assert ReasoningParser(fmt).parse("because") == ("", "because")


@pytest.mark.parametrize("value,want", [("none", "'none' (structured output off) is not implemented"),
                                        ("outlines", "'outlines' is not implemented: structured output runs on "
                                                     "xgrammar only"),
                                        ("llguidance", "'llguidance' is not implemented")])
def test_grammar_backend_other_than_xgrammar_is_refused(value, want, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--grammar-backend", value])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(f"hybridmoe serve: error: argument --grammar-backend: {want}"), err
    assert _parse(["--grammar-backend", "xgrammar"]).grammar_backend == "xgrammar"
    assert _parse([]).grammar_backend == "xgrammar"


@pytest.mark.parametrize("given, want", [("AMXBF16", "BF16"), ("amxbf16", "BF16"), ("amxint4", "AMXINT4"),
                                         ("LLAMAFILE", "LLAMAFILE")])
def test_ktransformers_method_names(given, want):
    assert PARSER.parse_args(["--kt-method", given]).kt_method == want


@pytest.mark.parametrize("given, want", [
    ("RAWINT4", "'RAWINT4' is a KTransformers method whose weight format hybridmoe does not compute"),
    ("mxfp4", "'mxfp4' is a KTransformers method"), ("int3", "'int3' is not a CPU expert method")])
def test_other_methods_are_refused_naming_the_value_and_what_is_accepted(given, want, capsys):
    from hybridmoe.check import check_main

    for run in (lambda: PARSER.parse_args(["--kt-method", given]), lambda: check_main(["--kt-method", given])):
        with pytest.raises(SystemExit) as e:
            run()
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and "accepted: AMXINT8, AMXINT4, BF16, LLAMAFILE, FP8" in err, err
        assert len(err.strip().splitlines()) == 1
