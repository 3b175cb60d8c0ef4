"""`serve` flags without a server: every SGLang/kt flag of the common command lines parses; those with no
feature here are refused naming the flag and why (exit code 2); help shows each default; defaults as
SGLang's; the mapped flags (attention backends, chat templates, KV dtype, watchdog, stream interval)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time

import pytest

from hybridmoe.config import ConfigError, EngineArgs, check_kv_cache_dtype
from hybridmoe.launch_server import build_parser, refusals, serve_main
from hybridmoe.sglang_compat import NO_OP_FLAGS, REFUSED_FLAGS, SINGLE_DEVICE_FLAGS

# KTransformers' kt-sglang guide line (Qwen3-30B-A3B), paths aside
SEED_FLAGS = ["--host", "0.0.0.0", "--port", "30000", "--model", "/m", "--kt-weight-path", "/w", "--kt-cpuinfer", "64",
              "--kt-threadpool-count", "2", "--kt-num-gpu-experts", "32", "--kt-method", "AMXINT4",
              "--attention-backend", "flashinfer", "--trust-remote-code", "--mem-fraction-static", "0.80",
              "--chunked-prefill-size", "16384", "--max-running-requests", "4", "--max-total-tokens", "32000",
              "--enable-mixed-chunk", "--tensor-parallel-size", "1", "--enable-p2p-check",
              "--disable-shared-experts-fusion", "--served-model-name", "Qwen3"]
# the flags the issue lists (issue 20), with SGLang-style values
ISSUE_FLAGS = ["--tp-size", "1", "--chat-template", "chatml", "--kv-cache-dtype", "fp8_e4m3", "--log-requests",
               "--log-requests-level", "1", "--enable-cache-report", "--dp-size", "1", "--ep-size", "1",
               "--revision", "main", "--download-dir", "/tmp/hub", "--allow-auto-truncate", "--stream-interval", "2",
               "--schedule-policy", "lpm", "--watchdog-timeout", "600", "--decode-log-interval", "10"]


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("argv", [SEED_FLAGS, ISSUE_FLAGS], ids=["seed_guide", "issue_20"])
def test_common_command_lines_parse_and_nothing_is_refused(argv: list[str]) -> None:
    assert refusals(argv, _parse(argv)) == []


@pytest.mark.parametrize("flag,reason", REFUSED_FLAGS, ids=[f for f, _ in REFUSED_FLAGS])
@pytest.mark.parametrize("values", [[], ["x"]], ids=["bare", "valued"])
def test_refused_flags_name_themselves_and_why(flag: str, reason: str, values: list[str], capsys) -> None:
    assert serve_main(["--device", "cpu", flag, *values]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hybridmoe serve: error: {flag}: {reason}; remove the flag"]


@pytest.mark.parametrize("flags", [["--lora-paths", "a=b", "c"], ["--kt-expert-lora-path", "d"],
                                   ["--max-loras-per-batch", "3"], ["--max-lora-rank", "16"], ["--enable-lora"],
                                   ["--lora-target-modules", "q_proj", "o_proj"]])
def test_lora_flags_are_accepted(flags: list[str]) -> None:  # issue 17: served (tests/lora)
    assert refusals(flags, _parse(flags)) == []


@pytest.mark.parametrize("flag", ["--kt-lora-path", "--lora-backend"])
def test_other_lora_flags_are_refused_with_a_reason(flag: str, capsys) -> None:
    assert serve_main([flag, "x"]) == 2
    assert "remove the flag" in capsys.readouterr().err


@pytest.mark.parametrize("flags,default,reason", SINGLE_DEVICE_FLAGS, ids=[f[0] for f, _, _ in SINGLE_DEVICE_FLAGS])
def test_single_device_sizes(flags: tuple[str, ...], default: int, reason: str, capsys) -> None:
    for spelling in flags:
        assert refusals([spelling, str(default)], _parse([spelling, str(default)])) == []
    assert serve_main([flags[-1], str(default + 2)]) == 2
    assert capsys.readouterr().err.strip() == (f"hybridmoe serve: error: {flags[0]} {default + 2}: only {default} is "
                                               f"supported; {reason}")


def test_several_refusals_are_one_line_each(capsys) -> None:
    assert serve_main(["--tp-size", "2", "--enable-torch-compile", "--lora-backend", "triton"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("hybridmoe serve: error: ") for line in err), err
    assert any("--tp-size 2: only 1 is supported" in line for line in err)
    assert any("--enable-torch-compile: torch.compile is not used" in line for line in err)
    assert any("--lora-backend" in line and "hybridmoe's own" in line for line in err)
    assert "not wired into the server" not in "".join(err)


@pytest.mark.parametrize("flag", [f for f, _ in NO_OP_FLAGS])
def test_no_op_flags_are_accepted(flag: str) -> None:
    ns = _parse([flag])
    assert getattr(ns, flag[2:].replace("-", "_")) is True and refusals([flag], ns) == []


def test_sglang_prefill_graph_flags_map_to_ours() -> None:
    from hybridmoe.args import engine_args_from

    assert engine_args_from(_parse([])).cuda_graph_max_prefill_tokens == 512
    assert engine_args_from(_parse(["--piecewise-cuda-graph-max-tokens", "256"])).cuda_graph_max_prefill_tokens == 256
    assert engine_args_from(_parse(["--cuda-graph-max-prefill-tokens", "96"])).cuda_graph_max_prefill_tokens == 96
    assert engine_args_from(_parse(["--disable-piecewise-cuda-graph"])).cuda_graph_max_prefill_tokens == 0
    with pytest.raises(ConfigError, match="cuda-graph-max-prefill-tokens"):
        engine_args_from(_parse(["--piecewise-cuda-graph-max-tokens", "-4"]))


def test_help_shows_every_default() -> None:
    parser = build_parser()
    assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings}: no help text"
    text = " ".join(parser.format_help().split())
    for shown in ("--port PORT TCP port (default: 30000)", "(default: 127.0.0.1)", "(default: fcfs)",
                  "(default: 300.0)", "(default: 40)", "(default: AMXINT8)", "(default: auto)"):
        assert shown in text, shown
    assert "KTransformers' kt-sglang stack defaults to AMXINT4" in text


def test_defaults_are_sglangs() -> None:
    ns = _parse([])
    assert (ns.host, ns.port, ns.tp_size, ns.dp_size, ns.ep_size) == ("127.0.0.1", 30000, 1, 1, 1)
    d = EngineArgs()
    assert (d.schedule_policy, d.stream_interval, d.decode_log_interval, d.watchdog_timeout) == ("fcfs", 1, 40, 300.0)
    assert (d.kv_cache_dtype, d.log_requests, d.log_requests_level, d.enable_cache_report) == ("auto", False, 2, False)
    assert (d.allow_auto_truncate, d.chat_template, d.revision, d.download_dir) == (False, None, None, None)


@pytest.mark.parametrize("name,device,ours", [("flashinfer", "cpu", "torch"), ("fa3", "cpu", "torch"),
                                              ("flashmla", "cuda", "triton"), ("torch_native", "cuda", "torch"),
                                              ("triton", "cpu", "triton"), ("torch", "cuda", "torch")])
def test_attention_backend_names(name: str, device: str, ours: str, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hybridmoe.config"):
        args = EngineArgs.from_kwargs(attention_backend=name, device=device)
    assert args.attention_backend == ours
    lines = [r.getMessage() for r in caplog.records if "--attention-backend" in r.getMessage()]
    if name in ("torch", "triton"):
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(f"--attention-backend {name}: running hybridmoe's {ours}")


def test_bad_values_name_the_flag() -> None:
    for kwargs, flag in (({"attention_backend": "nope"}, "--attention-backend"), ({"kv_cache_dtype": "fp4"},
                         "--kv-cache-dtype"), ({"schedule_policy": "lof"}, "--schedule-policy"),
                         ({"stream_interval": 0}, "--stream-interval"), ({"decode_log_interval": -1},
                         "--decode-log-interval"), ({"watchdog_timeout": 0}, "--watchdog-timeout"),
                         ({"log_requests_level": 4}, "--log-requests-level"), ({"revision": ""}, "--revision")):
        with pytest.raises(ConfigError, match=flag):
            EngineArgs.from_kwargs(**kwargs)


def test_fp8_kv_cache_is_refused_for_mla_models() -> None:
    class MLAConfig:
        kv_lora_rank = 512

    with pytest.raises(ConfigError, match="not supported for MLA models"):
        check_kv_cache_dtype(EngineArgs(kv_cache_dtype="fp8_e5m2", device="cpu"), MLAConfig())
    check_kv_cache_dtype(EngineArgs(kv_cache_dtype="auto"), MLAConfig())
    check_kv_cache_dtype(EngineArgs(kv_cache_dtype="fp8_e4m3", device="cpu"), object())


def test_chat_template_file_or_name(tmp_path) -> None:
    from hybridmoe.chat_templates import BUILTIN_TEMPLATES, load_chat_template
    from hybridmoe.server.templates import render_chat

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_chat(load_chat_template("chatml"), msgs, add_generation_prompt=True, continue_final_message=False,
                       variables={})
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    text = render_chat(BUILTIN_TEMPLATES["llama-3-instruct"], msgs[1:], add_generation_prompt=True,
                       continue_final_message=False, variables={"bos_token": "<s>"})
    assert text == "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant" \
                   "<|end_header_id|>\n\n"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert EngineArgs.from_kwargs(chat_template=str(f)).chat_template == str(f)
    assert load_chat_template(str(f)).startswith("{% for")
    (tmp_path / "t.json").write_text("{}")
    for bad, why in ((str(tmp_path / "nope.jinja"), "no such file, and not a built-in template name"),
                     (str(tmp_path / "t.json"), "JSON conversation templates")):
        with pytest.raises(ConfigError, match=why):
            EngineArgs.from_kwargs(chat_template=bad)


def test_cache_report_usage() -> None:
    from hybridmoe.server.openai_api import _usage

    outs = [{"meta_info": {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 4}}]
    assert _usage(outs)["prompt_tokens_details"] is None  # as SGLang without --enable-cache-report
    assert _usage(outs, cache_report=True)["prompt_tokens_details"] == {"cached_tokens": 4}


def test_stream_interval() -> None:
    from hybridmoe.server.async_engine import RequestStream

    stream = RequestStream("r", 3)  # the first token at once, then every 3 new tokens
    assert [n for n in range(1, 11) if stream._due({"output_ids": list(range(n))})] == [1, 4, 7, 10]
    every = RequestStream("r", 1)
    assert [n for n in range(1, 6) if every._due({"output_ids": list(range(n))})] == [1, 2, 3, 4, 5]

    async def run() -> list[int]:  # outputs arrive one at a time; the final one is always sent
        stream = RequestStream("r", 3)

        async def feed() -> None:
            for n in range(1, 6):
                stream.queue.put_nowait({"output_ids": list(range(n)), "meta_info": {
                    "finish_reason": {"type": "length"} if n == 5 else None}})
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(feed())
        got = [len(out["output_ids"]) async for out in stream]
        await task
        return got

    assert asyncio.run(run()) == [1, 4, 5]


def test_watchdog_fires_on_a_long_step_only(caplog) -> None:
    from hybridmoe.server.watchdog import StepWatchdog

    fired = threading.Event()
    dog = StepWatchdog(0.3, on_timeout=fired.set)

    def engine_thread() -> None:
        dog.start()
        for _ in range(3):  # short steps: nothing
            dog.begin()
            time.sleep(0.05)
            dog.end()
        time.sleep(0.6)  # idle between steps: nothing
        assert not fired.is_set()
        dog.begin()
        fired.wait(5)  # a step that hangs

    with caplog.at_level(logging.ERROR, logger="hybridmoe.server.watchdog"):
        t = threading.Thread(target=engine_thread)
        t.start()
        t.join(10)
    assert fired.is_set() and dog.fired
    msg = "\n".join(r.getMessage() for r in caplog.records)
    assert "an engine step has run for more than 0.3 s (--watchdog-timeout)" in msg
    assert "engine_thread" in msg  # the hanging thread's stack
