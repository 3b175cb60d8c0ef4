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

MiB = 1 << 20


class LimitsError(ValueError):
    """A limit flag out of range; the message is one line naming the flag."""


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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" or isinstance(value, bool):
                continue
            flag = "--" + f.name.replace("_", "-")
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            if f.type == "int":
                ok = ok and isinstance(value, int)
            if not ok:
                kind = "an integer" if f.type == "int" else "a number of seconds"
                raise LimitsError(f"{flag}: got {value!r}, expected {kind} > 0")

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
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a size like 16MiB or 1048576, got {text!r}") from None


def add_server_limit_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """The limit flags (defaults from ServerLimits)."""
    d = ServerLimits()
    g = group.add_argument
    g("--max-request-body-size", type=_size, default=d.max_request_body_size,
      help="largest request body, e.g. 16MiB (413 beyond)")
    g("--header-timeout", type=float, default=d.header_timeout,
      help="seconds a connection may take to send a request's headers (then it is closed)")
    g("--body-timeout", type=float, default=d.body_timeout,
      help="seconds a client may take to send a request body (408 beyond)")
    g("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
      help="seconds an idle keep-alive connection stays open")
    g("--max-connections", type=int, default=d.max_connections, help="open connections beyond this get 503")
    g("--write-timeout", type=float, default=d.write_timeout,
      help="seconds a client may read nothing of a response before it is cut off and its request aborted")
    g("--tokenize-timeout", type=float, default=d.tokenize_timeout,
      help="seconds tokenizing or detokenizing one input may take (400 beyond)")
    g("--chat-template-timeout", type=float, default=d.chat_template_timeout,
      help="seconds rendering a chat template may take (400 beyond)")
    g("--tokenizer-workers", type=int, default=d.tokenizer_workers,
      help="processes that tokenize large inputs and render chat templates, off the event loop")
    g("--allow-client-chat-template", action="store_true",
      help="accept a client's chat_template_kwargs.chat_template (rendered sandboxed, time-limited)")
    g("--max-top-logprobs-num", type=int, default=d.max_top_logprobs_num,
      help="most top logprobs a request may ask for per token, on every route")
