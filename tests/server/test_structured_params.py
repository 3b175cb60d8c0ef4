"""server/structured.py without a server: OpenAI fields -> sampling parameters, and attach_grammar's
limits (size, compile timeout) and errors."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from types import SimpleNamespace
from unittest.mock import patch

import pytest

from hybridmoe.engine.grammar import GrammarBackend, GrammarError, RequestGrammar
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.server.errors import APIError
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.protocol import ChatCompletionRequest
from hybridmoe.server.structured import JSON_OBJECT_SCHEMA, attach_grammar, structured_params

MSG = [{"role": "user", "content": "x"}]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **fields})


def test_response_format_to_sampling_params():
    assert structured_params(_chat()) == {}
    assert structured_params(_chat(response_format={"type": "text"})) == {}
    assert structured_params(_chat(response_format={"type": "json_object"})) == {"json_schema": JSON_OBJECT_SCHEMA}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = structured_params(_chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema, "strict": True}}, logit_bias={"7": -100}))
    assert json.loads(got["json_schema"]) == schema and got["logit_bias"] == {"7": -100}
    assert structured_params(_chat(response_format={"type": "json_schema", "json_schema": {"name": "s"}})) == {
        "json_schema": JSON_OBJECT_SCHEMA}  # no schema: any object
    assert structured_params(_chat(regex="a+")) == {"regex": "a+"}


def test_two_constraints_are_refused_by_name():
    with pytest.raises(APIError) as info:
        structured_params(_chat(response_format={"type": "json_object"}, ebnf='root ::= "a"'))
    assert info.value.status == 400 and "response_format and ebnf" in info.value.message


class _Stuck:
    """A backend whose compile starts and never ends."""

    def submit(self, kind: str, text: str) -> concurrent.futures.Future:
        job = concurrent.futures.Future()
        assert job.set_running_or_notify_cancel()
        return job


def _state(backend, **limits) -> SimpleNamespace:
    return SimpleNamespace(limits=ServerLimits(**limits), core=SimpleNamespace(grammars=SimpleNamespace(
        backend=backend)))


def _req(**params) -> Req:
    return Req(rid="r", prompt_ids=[1], params=SamplingParams(**params))


def test_attach_grammar_compiles_and_refuses():
    be = GrammarBackend.for_vocab(["a", "b", "<eos>"], [2])
    req = _req(regex="(ab)+")
    asyncio.run(attach_grammar(_state(be), req))
    assert isinstance(req.grammar, RequestGrammar)
    plain = _req()
    asyncio.run(attach_grammar(_state(be), plain))
    assert plain.grammar is None
    with pytest.raises(APIError, match="regex does not compile"):
        asyncio.run(attach_grammar(_state(be), _req(regex="(a")))
    with pytest.raises(APIError, match="--max-grammar-size"):
        asyncio.run(attach_grammar(_state(be, max_grammar_size=4), _req(regex="aaaaa")))
    be.close()


def test_attach_grammar_times_out():
    with pytest.raises(APIError, match="did not compile within 0.05 s"):
        asyncio.run(attach_grammar(_state(_Stuck(), grammar_compile_timeout=0.05), _req(ebnf='root ::= "a"')))


def test_no_tokenizer_is_a_400():
    from hybridmoe.engine.grammar import EngineGrammars

    state = _state(None)
    state.core.grammars = EngineGrammars(None, 10, [0])
    with pytest.raises(APIError, match="tokenizer"):
        asyncio.run(attach_grammar(state, _req(regex="a")))
    with pytest.raises(GrammarError):
        state.core.grammars.attach(_req(regex="a"))


class _Blocking(GrammarBackend):
    """One compile thread; compiling a regex that starts with "slow" waits for `release`, so later compiles
    queue behind it."""

    def __init__(self) -> None:
        super().__init__(lambda: None, threads=1)
        self.release = threading.Event()
        self.ran: list[str] = []

    def _compile_now(self, kind: str, text: str):
        self.ran.append(text)
        if text.startswith("slow"):
            assert self.release.wait(30)
        return SimpleNamespace(memory_size_bytes=1, text=text)


def test_a_compile_queued_past_the_timeout_is_a_503_and_never_runs():
    be = _Blocking()
    be._cache[("regex", "cached")] = SimpleNamespace(memory_size_bytes=1, text="cached")
    state = _state(be, grammar_compile_timeout=0.2)

    async def main() -> None:
        slow = asyncio.create_task(attach_grammar(state, _req(regex="slow")))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as queued:  # behind "slow" on the one thread
            await attach_grammar(state, _req(regex="queued"))
        assert queued.value.status == 503 and "busy" in queued.value.message and queued.value.param == "regex"
        # a cached grammar is not queued behind the compile
        with patch("hybridmoe.server.structured.RequestGrammar", lambda c: c):
            cached = _req(regex="cached")
            await attach_grammar(state, cached)
            assert cached.grammar.text == "cached"
            with pytest.raises(APIError) as slow_err:  # it started: the grammar's own time ran out
                await slow
            assert slow_err.value.status == 400 and "did not compile within 0.2 s" in slow_err.value.message
            # a client that leaves drops its queued compile too
            left = asyncio.create_task(attach_grammar(state, _req(regex="left")))
            await asyncio.sleep(0.05)
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            be.release.set()
            await asyncio.sleep(0.1)
            after = _req(regex="after")
            await attach_grammar(state, after)  # the thread is free again
            assert after.grammar.text == "after"

    asyncio.run(main())
    assert be.ran == ["slow", "after"]  # "queued" and "left" never compiled
    assert be.cached("regex", "slow")  # the timed-out compile finished and was kept
    be.close()
