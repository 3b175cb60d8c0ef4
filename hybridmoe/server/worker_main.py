"""The body of a tokenizer worker process (started by workers.py): jobs in, results out, over a pipe.

Kept apart from workers.py so a worker imports only what it needs (the tokenizer's classes and
jinja2, no torch, no web framework): it starts in about a second.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

from hybridmoe.server.templates import ChatTemplateError, model_template, render_chat, special_tokens


def parse_json(body: bytes) -> tuple[str, Any]:
    """("json", value) | ("json_error", (message, position)): every way a body fails to parse named (json.loads
    raises more than JSONDecodeError: bad UTF-8, nesting past the recursion limit, an integer of more digits
    than Python converts)."""
    try:
        return "json", json.loads(body)
    except json.JSONDecodeError as e:
        return "json_error", (e.msg, e.pos)
    except UnicodeDecodeError as e:
        return "json_error", (f"not UTF-8 ({e.reason})", e.start)
    except RecursionError:
        return "json_error", ("nested too deeply", 0)
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        return "json_error", (str(e).split(";")[0], 0)


def run_job(tok: Any, job: tuple) -> tuple[str, Any]:
    """One job -> ("ids", ids) | ("too_long", n) | ("text", text) | ("template", message) |
    ("json", value) | ("json_error", (message, position)) | ("batch", [one reply per input])."""
    kind = job[0]
    if kind == "json":
        return parse_json(job[1])
    if kind == "encode_batch":  # a batch's prompts in one job: the server's event loop pays per job, not per prompt
        _, texts, add_special_tokens, max_len = job
        return "batch", [_each(lambda t=t: _ids(tok.encode(t, add_special_tokens=add_special_tokens, verbose=False),
                                                max_len)) for t in texts]
    if kind == "decode_batch":
        _, seqs, skip_special_tokens = job
        return "batch", [_each(lambda s=s: ("text", tok.decode(s, skip_special_tokens=skip_special_tokens)))
                         for s in seqs]
    if kind == "encode":
        _, text, add_special_tokens, max_len = job
        # verbose=False: not transformers' "Token indices sequence length is longer than ..." line (once per
        # process, outside the server's log format) for a prompt past the model's length: the 400 names it
        return _ids(tok.encode(text, add_special_tokens=add_special_tokens, verbose=False), max_len)
    if kind == "decode":
        _, ids, skip_special_tokens = job
        return "text", tok.decode(ids, skip_special_tokens=skip_special_tokens)
    if kind == "chat":
        _, source, messages, add_generation_prompt, continue_final_message, kwargs, max_len = job
        try:
            text = render_chat(source or model_template(tok) or "", messages, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               variables={**special_tokens(tok), **kwargs})
        except ChatTemplateError as e:
            return "template", str(e)
        return _ids(tok.encode(text, add_special_tokens=False, verbose=False), max_len)
    raise ValueError(f"unknown job {kind!r}")


def _each(one: Callable[[], tuple[str, Any]]) -> tuple[str, Any]:
    """One input of a batch job: its failure is its own ("error", message), reported with its index, and the
    batch's other inputs are still answered."""
    try:
        return one()
    except Exception as e:  # noqa: BLE001  (a tokenizer raises anything; the server names the input)
        return "error", f"{type(e).__name__}: {e}"


def _ids(ids: list[int], max_len: int | None) -> tuple[str, Any]:
    # A prompt past the limit comes back as its length only: a huge id list would cost the
    # server's event loop its unpickling.
    if max_len is not None and len(ids) >= max_len:
        return "too_long", len(ids)
    return "ids", ids


def main(conn: Any, tokenizer_blob: bytes) -> None:
    """Load the tokenizer, say ready, then serve jobs until the pipe closes."""
    try:
        try:
            tok = pickle.loads(tokenizer_blob)
        except Exception as e:  # reported to the pool, which logs it
            conn.send(("failed", f"{type(e).__name__}: {e}"))
            return
        conn.send(("ready", None))
        while True:
            job = conn.recv()
            if job[0] == "json":  # the body follows as raw bytes (no pickled copy of it)
                job = ("json", conn.recv_bytes())
            try:
                reply = run_job(tok, job)
            except Exception as e:
                reply = ("error", f"{type(e).__name__}: {e}")
            conn.send(reply)
    except (EOFError, OSError):  # the server is gone (or stopped this worker): nothing to report to
        return
