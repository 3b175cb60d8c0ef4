"""`hybridmoe serve` / `python -m hybridmoe.launch_server`: flags -> EngineArgs -> HTTP server."""

from __future__ import annotations

import argparse
import math
import sys

from hybridmoe.args import OneLineParser, add_engine_args, engine_args_from
from hybridmoe.config import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ConfigError,
    ServerConfig,
    parser_names,
    reasoning_parser_name,
    tool_call_parser_name,
)
from hybridmoe.config_file import expand_config_file
from hybridmoe.hub import resolve_hub_paths
from hybridmoe.server.limits import ServerLimits, add_server_limit_args
from hybridmoe.server.sampling_defaults import SAMPLING_DEFAULTS, load_sampling_defaults
from hybridmoe.sglang_compat import log_ignored, refused
from hybridmoe.sglang_flags import REASONING_PARSER_ALIASES, TOOL_CALL_PARSER_ALIASES

# Hybrid CPU/GPU options whose feature is not in this version yet: accepted by the parser (so a
# KTransformers command line parses) and refused at startup with exit code 2, never ignored.
# Remove a flag here once the engine implements it.
NOT_YET_AVAILABLE: tuple[str, ...] = ()
KT_METHODS_AVAILABLE = ("AMXINT8", "AMXINT4", "BF16", "FP8", "LLAMAFILE")
KT_METHOD_LANDS: dict[str, str] = {}  # a method refused at startup: why, and what to use meanwhile
DEFAULT_GRACE_S = 30.0
MAX_GRACE_S = 86400.0


def _have(p: argparse.ArgumentParser, flag: str) -> bool:
    return flag in p._option_string_actions


def _checked(check):
    """An argparse type of a check that raises ConfigError: argparse's one-line error naming the flag."""
    def convert(value: str) -> str:
        try:
            return check(value)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = check.__name__
    return convert


def grammar_backend(value: str) -> str:
    """--grammar-backend: xgrammar is the one backend; SGLang's others, and `none` (structured output off),
    are refused."""
    if value == "xgrammar":
        return value
    if value == "none":
        raise ConfigError("'none' (structured output off) is not implemented: xgrammar is always on, and requests "
                          "without a constraint never use it; leave the flag out")
    raise ConfigError(f"{value!r} is not implemented: structured output runs on xgrammar only; leave the flag out")


def build_parser() -> argparse.ArgumentParser:
    """The serve parser: the engine flags of args.py plus the server's own."""
    p = OneLineParser(prog="hybridmoe serve", allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                      usage="%(prog)s [--model-path PATH] [OPTIONS]  (the options are listed below)",
                      description="HTTP server with SGLang's native API and the OpenAI API; takes the flags of "
                                  "`python -m sglang.launch_server` (those it cannot honour are refused, saying why).")
    add_engine_args(p)
    s = p.add_argument_group("server")
    if not _have(p, "--host"):
        s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    if not _have(p, "--port"):
        s.add_argument("--port", type=int, default=30000, help="TCP port")
    if not _have(p, "--served-model-name"):
        s.add_argument("--served-model-name", default=None, help="the model name of the OpenAI API")
    if not _have(p, "--api-key"):
        s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' (not on /health)")
    if not _have(p, "--enable-metrics"):
        s.add_argument("--enable-metrics", action="store_true", help="Prometheus metrics at GET /metrics")
    if not _have(p, "--max-queued-requests"):
        s.add_argument("--max-queued-requests", type=int, default=None,
                       help="requests waiting for their first token beyond this get 503")
    if not _have(p, "--grammar-backend"):  # SGLang's flag; xgrammar is the one backend here
        s.add_argument("--grammar-backend", type=_checked(grammar_backend), default="xgrammar",
                       help="structured output's grammar backend: xgrammar only (SGLang's outlines, llguidance and "
                            "none are refused)")
    if not _have(p, "--allowed-origins"):
        s.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="allow cross-origin (CORS) requests from these origins, `*` for any (default: none)")
    if not _have(p, "--tool-call-parser"):
        s.add_argument("--tool-call-parser", default=None, type=_checked(tool_call_parser_name),
                       help="the model's tool-call format, parsed into OpenAI tool_calls on /v1/chat/completions "
                            "(qwen25: Qwen2.5/Qwen3 <tool_call> JSON; deepseekv3: DeepSeek-V3; kimi_k2: Kimi-K2); "
                            "also what tool_choice required or a named function enforces with a grammar; one of "
                            f"{parser_names(TOOL_CALL_PARSERS, TOOL_CALL_PARSER_ALIASES)}")
    if not _have(p, "--reasoning-parser"):
        s.add_argument("--reasoning-parser", default=None, type=_checked(reasoning_parser_name),
                       help="split the model's thinking part into reasoning_content (qwen3: <think>...</think>; "
                            "qwen3-thinking: the same, the output starting inside the thinking part; "
                            "deepseek-r1: the output starts inside the thinking part; kimi: ◁think▷...◁/think▷; "
                            "kimi_k2: <think> ended by </think> or a tool-call section); one of "
                            f"{parser_names(REASONING_PARSERS, REASONING_PARSER_ALIASES)}")
    s.add_argument("--config", metavar="FILE.yaml", default=None,
                   help="read options from a YAML file of option names and values (`model-path: /models/x`, a switch "
                        "true or false, several values as a list), as SGLang's --config; the command line's win")
    s.add_argument("--sampling-defaults", choices=SAMPLING_DEFAULTS, default="model",
                   help="where a chat request's unset temperature, top_p, top_k, min_p and repetition_penalty come "
                        "from (/v1/chat/completions, /v1/responses): model: the model's generation_config.json, as "
                        "SGLang does; openai: the built-in defaults (temperature 1, top_p 1, top_k -1)")
    s.add_argument("--preferred-sampling-params", default=None, metavar="JSON",
                   help="default sampling parameters of every request on every route, under the request's own values "
                        "(and the chat routes' model values), e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}'")
    s.add_argument("--graceful-shutdown-timeout", type=float, default=DEFAULT_GRACE_S,
                   help="on SIGTERM, seconds running requests may take to finish before they are aborted")
    add_server_limit_args(p.add_argument_group("server limits"))
    return p


def flags_given(argv: list[str]) -> set[str]:
    """The long options present on a command line (`--flag value` and `--flag=value`)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def unavailable_flags(argv: list[str], ns: argparse.Namespace) -> list[str]:
    """Flags given that this version cannot honour yet."""
    given = flags_given(argv)
    bad = [f for f in NOT_YET_AVAILABLE if f in given]
    if ns.kt_method not in KT_METHODS_AVAILABLE:
        bad.append(f"--kt-method {ns.kt_method}")
    return bad


def refusals(argv: list[str], ns: argparse.Namespace) -> list[str]:
    """One line per flag given that this version refuses, saying why (SGLang flags and kt methods)."""
    lines = refused(ns)
    for flag in unavailable_flags(argv, ns):
        why = KT_METHOD_LANDS.get(flag, "")
        lines.append(f"{flag}: not yet available in this version{why}; remove the flag")
    return lines


def serve_main(argv: list[str] | None = None) -> int:
    """Parse serve flags and run the server until SIGTERM/SIGINT; the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        argv = expand_config_file(argv, parser)
    except ConfigError as e:
        parser.error(str(e))
    ns = parser.parse_args(argv)
    from hybridmoe.log import configure

    configure(ns.log_level)
    bad = refusals(argv, ns)
    if bad:
        for line in bad:
            print(f"hybridmoe serve: error: {line}", file=sys.stderr)
        return 2
    log_ignored(ns)  # SGLang flags accepted with no effect: one line each
    from hybridmoe.startup import prepare, report_failure

    debug = ns.log_level == "debug"
    try:
        grace = ns.graceful_shutdown_timeout
        if not (math.isfinite(grace) and 0 <= grace <= MAX_GRACE_S):
            raise ConfigError(f"--graceful-shutdown-timeout: got {grace}, expected seconds in [0, {MAX_GRACE_S:.0f}]")
        limits = ServerLimits.from_namespace(ns)
        server_config = ServerConfig.from_namespace(ns)
        # every check that needs no model load runs before the port is bound: nothing says ready
        args = prepare(resolve_hub_paths(engine_args_from(ns)))
        load_sampling_defaults(args.model_path, server_config.sampling_defaults, server_config.preferred_sampling_params)
        from hybridmoe.server.run import run_server

        rc = run_server(args, server_config, graceful_shutdown_timeout=grace, limits=limits)
    except Exception as e:
        return report_failure("hybridmoe serve", e, debug)
    # run_server gives 1 when the model failed to load (one ERROR line was logged; an address it cannot listen on
    # is a ConfigError above): a startup failure, exit code 2 like the failures above
    return 2 if rc == 1 else rc


if __name__ == "__main__":
    sys.exit(serve_main())
