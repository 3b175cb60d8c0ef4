"""Structured output and logit bias at the HTTP boundary: OpenAI fields -> SGLang sampling parameters, and
each request's grammar compiled on the grammar backend's threads (never on the event loop) before the
request is queued, so a grammar that does not compile is a 400 with the compiler's message.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from hybridmoe.engine.grammar import GrammarError, RequestGrammar, grammar_of
from hybridmoe.engine.request import Req
from hybridmoe.server.errors import APIError

# What json_object asks for (OpenAI's JSON mode): any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def structured_params(body: Any) -> dict[str, Any]:
    """The sampling parameters (json_schema / regex / ebnf, logit_bias) of an OpenAI request body
    (protocol.SamplingFields); APIError(400) naming them when more than one constraint is given."""
    picks: dict[str, tuple[str, str]] = {}  # request field -> (sampling parameter, text)
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        picks["response_format"] = ("json_schema", JSON_OBJECT_SCHEMA)
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        picks["response_format"] = ("json_schema", json.dumps(schema) if schema is not None else JSON_OBJECT_SCHEMA)
    for name in ("json_schema", "regex", "ebnf"):
        value = getattr(body, name, None)
        if value is not None:
            picks[name] = (name, value)
    if len(picks) > 1:
        names = list(picks)
        raise APIError(400, f"{' and '.join(names)} are both given: a request takes at most one structured-output "
                            "constraint (response_format, json_schema, regex or ebnf)", param=names[1])
    out = {kind: text for kind, text in picks.values()}
    if getattr(body, "logit_bias", None):
        out["logit_bias"] = dict(body.logit_bias)
    return out


def grammar_fields(body: Any) -> dict[str, str]:
    """Sampling parameter -> the OpenAI request field that gave it (`json_schema` from response_format, or the
    SGLang extra of its own name): what an error about the grammar names as its `param`."""
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type in ("json_object", "json_schema"):
        return {"json_schema": "response_format"}
    return {name: name for name in ("json_schema", "regex", "ebnf") if getattr(body, name, None) is not None}


async def attach_grammar(state: Any, req: Req, names: Callable[[str], str | None] | None = None) -> None:
    """Compile the request's grammar (cached by content) off the event loop and give the request its
    matcher; APIError(400) when it is too large, does not compile, or accepts no token at all. No-op without
    a constraint. names: how the route names the grammar's field in `param` (response_format, tool_choice...)."""
    spec = grammar_of(req.params)
    if spec is None:
        return
    kind, text = spec
    param = (names or (lambda k: k))(kind)
    limit = state.limits.max_grammar_size
    if len(text) > limit:
        raise APIError(400, f"{kind} has {len(text)} characters; this server's limit is {limit} "
                            "(--max-grammar-size raises it)", param=param)
    timeout = state.limits.grammar_compile_timeout
    try:
        backend = state.core.grammars.backend
        job = backend.submit(kind, text)
    except GrammarError as e:
        raise APIError(400, str(e), param=param) from None
    # shielded: a compile that outlives the timeout goes on and is cached for the next request
    inner = asyncio.wrap_future(job)
    inner.add_done_callback(_retrieve)
    try:
        compiled = await asyncio.wait_for(asyncio.shield(inner), timeout)
    except GrammarError as e:
        raise APIError(400, str(e), param=param) from None
    except asyncio.TimeoutError:
        # Still queued behind other compiles: it never runs (a backlog nobody waits for would hold every later
        # grammar back), and the grammar is not at fault: 503, retry.
        if job.cancel():
            raise APIError(503, f"the grammar compile threads were busy for {timeout:g} s "
                                "(--grammar-compile-timeout); retry later", param=param) from None
        raise APIError(400, f"{kind} did not compile within {timeout:g} s (--grammar-compile-timeout); a smaller "
                            "grammar compiles faster", param=param) from None
    except asyncio.CancelledError:  # the client left: a queued compile is dropped, a running one is cached
        job.cancel()
        raise
    grammar = RequestGrammar(compiled)
    if not await _accepts_a_first_token(backend, kind, text, grammar):
        # e.g. `root ::= root`: the engine would mask every token, sample one anyway and end the request with
        # an abort ("the sampled token 0 does not fit the request's grammar") after a prefill for nothing
        raise APIError(400, f"{kind} accepts no output: the grammar allows no token at the first step (a rule that "
                            "only refers to itself, or a pattern no token of the vocabulary can start)", param=param)
    req.grammar = grammar


# backend -> (kind, text) -> whether the grammar's start allows some token: a property of the grammar and the
# vocabulary alone, so asked once (a batch of one grammar asks once, not once a prompt); bounded like the backend's
# own cache of compiled grammars
_FIRST_TOKEN: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str], bool]] = weakref.WeakKeyDictionary()
_FIRST_TOKEN_ENTRIES = 256


async def _accepts_a_first_token(backend: Any, kind: str, text: str, grammar: RequestGrammar) -> bool:
    known_of = _FIRST_TOKEN.setdefault(backend, OrderedDict())
    known = known_of.get((kind, text))
    if known is None:
        # one mask over the vocabulary (~0.1 ms for 4k tokens, more for 150k): on a thread, not the event loop
        known = await asyncio.to_thread(_first_mask_has_a_token, grammar)
        known_of[(kind, text)] = known
        while len(known_of) > _FIRST_TOKEN_ENTRIES:
            known_of.popitem(last=False)
    return known


def _first_mask_has_a_token(grammar: RequestGrammar) -> bool:
    """Whether the grammar's initial state allows any token (its matcher is not advanced). A grammar whose mask
    cannot be computed here (a test double without one) is taken as accepting: the engine still reports a dead
    end as before; this check only refuses what it has seen refuse everything."""
    try:
        vocab = grammar.compiled.tokenizer_info.vocab_size
        mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        grammar.fill(mask, 0)
    except Exception:  # noqa: BLE001  (see above)
        return True
    return bool(mask.any())


def _retrieve(fut: asyncio.Future) -> None:
    """Take a finished compile's error, so one nobody awaits any more (timed out) is not logged as lost."""
    if not fut.cancelled():
        fut.exception()
