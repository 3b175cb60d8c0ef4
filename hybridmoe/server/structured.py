"""Structured output and logit bias at the HTTP boundary: OpenAI fields -> SGLang sampling parameters, and
each request's grammar compiled on the grammar backend's threads (never on the event loop) before the
request is queued, so a grammar that does not compile is a 400 with the compiler's message.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

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


async def attach_grammar(state: Any, req: Req) -> None:
    """Compile the request's grammar (cached by content) off the event loop and give the request its
    matcher; APIError(400) when it is too large or does not compile. No-op without a constraint."""
    spec = grammar_of(req.params)
    if spec is None:
        return
    kind, text = spec
    limit = state.limits.max_grammar_size
    if len(text) > limit:
        raise APIError(400, f"{kind} has {len(text)} characters; this server's limit is {limit} "
                            "(--max-grammar-size raises it)", param=kind)
    timeout = state.limits.grammar_compile_timeout
    try:
        backend = state.core.grammars.backend
        job = backend.submit(kind, text)
    except GrammarError as e:
        raise APIError(400, str(e), param=kind) from None
    # shielded: a compile that outlives the timeout goes on and is cached for the next request
    inner = asyncio.wrap_future(job)
    inner.add_done_callback(_retrieve)
    try:
        compiled = await asyncio.wait_for(asyncio.shield(inner), timeout)
    except GrammarError as e:
        raise APIError(400, str(e), param=kind) from None
    except asyncio.TimeoutError:
        # Still queued behind other compiles: it never runs (a backlog nobody waits for would hold every later
        # grammar back), and the grammar is not at fault: 503, retry.
        if job.cancel():
            raise APIError(503, f"the grammar compile threads were busy for {timeout:g} s "
                                "(--grammar-compile-timeout); retry later", param=kind) from None
        raise APIError(400, f"{kind} did not compile within {timeout:g} s (--grammar-compile-timeout); a smaller "
                            "grammar compiles faster", param=kind) from None
    except asyncio.CancelledError:  # the client left: a queued compile is dropped, a running one is cached
        job.cancel()
        raise
    req.grammar = RequestGrammar(compiled)


def _retrieve(fut: asyncio.Future) -> None:
    """Take a finished compile's error, so one nobody awaits any more (timed out) is not logged as lost."""
    if not fut.cancelled():
        fut.exception()
