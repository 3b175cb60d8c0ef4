"""The server's limits: what a client may send, for how long, and how many at once. Each is a flag.

`ServerLimits` is frozen and validated once (from_namespace); the app keeps it at
`app.state.hybridmoe.limits`, the connection protocol (connections.py) reads it from the uvicorn
config.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from hybridmoe.config import INT_MAX, ConfigError

MiB = 1 << 20
# The time limits wait in multiprocessing's Connection.poll, whose timeout overflows a C int of milliseconds
# past ~24.8 days (OverflowError on every job it times, not at startup); a day bounds every limit here, as
# --graceful-shutdown-timeout's.
MAX_SECONDS = 86400.0
# Each tokenizer worker is a process holding its own copy of the tokenizer, spawned one after another at startup:
# a typo such as 100000 (or 2**63) spawned processes until the host ran out of memory.
MAX_TOKENIZER_WORKERS = 64


class LimitsError(ConfigError):
    """A limit flag out of range; the message is one line naming the flag (reported like any other flag error:
    `hybridmoe serve: error: --flag: ...`, without the class name)."""


@dataclass(frozen=True)
class ServerLimits:
    """Limits of the HTTP server. Times in seconds, sizes in bytes."""

    max_request_body_size: int = 16 * MiB  # 413 beyond
    header_timeout: float = 10.0  # a connection must send a request's headers within this
    body_timeout: float = 30.0  # and its body within this after the headers (408 otherwise)
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # connections beyond get 503
    write_timeout: float = 30.0  # a client that reads nothing for this long is cut off, its request aborted
    tokenize_timeout: float = 30.0  # tokenizing or detokenizing one input
    chat_template_timeout: float = 5.0  # rendering one chat template
    tokenizer_workers: int = 2  # processes that tokenize large inputs and render chat templates
    allow_client_chat_template: bool = False  # accept chat_template_kwargs.chat_template from clients
    max_top_logprobs_num: int = 20  # top_logprobs_num / logprobs / top_logprobs, on every route
    max_grammar_size: int = 128 * 1024  # characters of a json_schema, regex or ebnf (400 beyond)
    grammar_compile_timeout: float = 60.0  # a grammar compiling longer: 400 (it goes on compiling, then is cached);
    # one still queued behind other compiles then: 503, and it is dropped
    max_n_samples: int = 64  # n (parallel samples of one prompt), on every route
    max_sequences_per_request: int = 4096  # prompts of a batch times their n (/generate, /v1/completions); also
    # the inputs of a /tokenize or /detokenize batch

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" or isinstance(value, bool):
                continue
            flag = "--" + f.name.replace("_", "-")
            # (an int is not given to math.isfinite: one of 400 digits raised OverflowError there, naming no flag)
            ok = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
            ok = ok and value > 0
            if f.type == "int":  # counts at most INT_MAX, as the engine's; a size in bytes is only compared
                most = {"tokenizer_workers": MAX_TOKENIZER_WORKERS, "max_request_body_size": None}.get(f.name, INT_MAX)
                ok = ok and isinstance(value, int) and (most is None or value <= most)
                kind = "an integer > 0" if most is None else f"an integer in [1, {most}]"
            else:
                ok = ok and value <= MAX_SECONDS
                kind = f"a number of seconds in (0, {MAX_SECONDS:.0f}]"
            if not ok:
                raise LimitsError(f"{flag}: got {value!r}, expected {kind}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerLimits:
        """From parsed flags (add_server_limit_args); LimitsError naming the flag when out of range."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names and v is not None})


def _size(text: str) -> int:
    """'16MiB', '512k', '1048576' -> bytes."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": MiB, "mb": MiB, "mib": MiB,
             "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError, OverflowError):  # OverflowError: inf, 1e309 (argparse shows it as a traceback)
        raise argparse.ArgumentTypeError(f"expected a size like 16MiB or 1048576, got {text!r}") from None


# (flag, type, help) of each limit flag; the default is the ServerLimits field of the flag's name
_LIMIT_FLAGS: tuple[tuple[str, object, str], ...] = (
    ("--max-request-body-size", _size, "largest request body, e.g. 16MiB (413 beyond)"),
    ("--header-timeout", float, "seconds a connection may take to send a request's headers (then it is closed)"),
    ("--body-timeout", float, "seconds a client may take to send a request body (408 beyond)"),
    ("--timeout-keep-alive", float, "seconds an idle keep-alive connection stays open"),
    ("--max-connections", int, "open connections beyond this get 503"),
    ("--write-timeout", float,
     "seconds a client may read nothing of a response before it is cut off and its request aborted"),
    ("--tokenize-timeout", float, "seconds tokenizing or detokenizing one input may take (400 beyond)"),
    ("--chat-template-timeout", float, "seconds rendering a chat template may take (400 beyond)"),
    ("--tokenizer-workers", int, "processes that tokenize large inputs and render chat templates, off the event loop"),
    ("--max-top-logprobs-num", int, "most top logprobs a request may ask for per token, on every route"),
    ("--max-grammar-size", int, "most characters of a structured-output constraint (json_schema, regex, ebnf, "
     "response_format's schema; 400 beyond)"),
    ("--grammar-compile-timeout", float, "seconds a request's grammar may take to compile (400 beyond; the "
     "compiled grammar is cached when it finishes; 503 when it waited that long behind other compiles)"),
    ("--max-n-samples", int, "most parallel samples (n) a request may ask for per prompt, on every route (400 beyond)"),
    ("--max-sequences-per-request", int, "most sequences one request may start: the prompts of a batch (/generate, "
     "/v1/completions) times their n; also the most inputs of a /tokenize or /detokenize batch (400 beyond)"),
)


def add_server_limit_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """The limit flags (defaults from ServerLimits)."""
    d = ServerLimits()
    for flag, typ, text in _LIMIT_FLAGS:
        group.add_argument(flag, type=typ, default=getattr(d, flag[2:].replace("-", "_")), help=text)
    group.add_argument("--allow-client-chat-template", action="store_true",
                       help="accept a client's chat_template_kwargs.chat_template (rendered sandboxed, time-limited)")
