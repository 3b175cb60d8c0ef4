"""Regressions of the second API audit of the HTTP server: each test failed before its fix.

1. A batch of up to --max-sequences-per-request (4096) inputs to /tokenize, /detokenize, /generate (text) or
   /v1/completions (text) was one tokenizer job per input, whose event-loop share (~0.1 ms each) stalled every
   other request (a concurrent GET /health waited 0.4-0.9 s): now a few jobs a batch, with per-prompt errors
   naming the prompt's index.
2. Engine validation errors came back with `param: null` (the engine's RequestError carries only a message):
   now each route names the field as it spells it (`prompt`, `messages`, `max_tokens`, `sampling_params.top_k`).
3. A grammar that accepts nothing ended the request with finish_reason "abort" (not an OpenAI finish reason) and
   the message dropped: now a 400 naming the grammar's field before anything runs, and a grammar that dead-ends
   mid-answer is the request's error (400 with the engine's message; an error event when streamed), as SGLang
   answers a failed request on its OpenAI routes.
4. top_logprobs without logprobs: true was silently ignored on /v1/chat/completions; OpenAI refuses it (400).

An in-process server (tests/server/inproc.py) serves the demo model, so a test can count the tokenizer pool's
jobs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine, RequestError
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.openai_api import _abort_error
from hybridmoe.server.workers import BATCH_ITEMS, TokenizerPool, batch_chunks
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread

BATCH = 4096  # the default --max-sequences-per-request
MAX_JOBS = 8  # a 4096-input batch of short inputs: 4 jobs of BATCH_ITEMS
USER = [{"role": "user", "content": "hi"}]
DEAD = "root ::= root"  # accepts no token at all
DEAD_LATER = 'root ::= "a" r\nr ::= r'  # accepts "a", then nothing


@pytest.fixture(scope="module")
def engine() -> Engine:
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    return Engine(EngineArgs(model_path=str(DEMO), device="cpu"), progress=False)


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serve_in_thread(lambda args: engine, limits=ServerLimits(tokenizer_workers=1)) as base:
        yield base


@pytest.fixture()
def c(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


@pytest.fixture()
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tokenizer pool's jobs (their kinds) while a test runs (the server runs in this process)."""
    seen: list[str] = []
    real = TokenizerPool._run

    async def counted(self, job, *args, **kwargs):
        seen.append(job[0])
        return await real(self, job, *args, **kwargs)

    monkeypatch.setattr(TokenizerPool, "_run", counted)
    return seen


def _error(r: httpx.Response, status: int, param: str | None, word: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and word.lower() in err["message"].lower(), err
    return err


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# ---------------------------------------------------------------- 1. batches are a few jobs


def test_batch_chunks():
    assert batch_chunks([], 100) == []
    assert [len(r) for r in batch_chunks([1] * 2500, 1 << 20)] == [BATCH_ITEMS, BATCH_ITEMS, 2500 - 2 * BATCH_ITEMS]
    # past the size limit a job ends; an input larger than the limit is a job of its own
    assert batch_chunks([10, 2000, 10, 10], 1000) == [range(0, 1), range(1, 2), range(2, 4)]


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": [f"hello world {i}" for i in range(BATCH)]}),
    ("/detokenize", {"tokens": [[5, 6, 7, 8]] * BATCH}),
])
def test_a_4096_input_tokenize_batch_is_a_few_jobs(c, jobs, path, body):
    """Each input was a job of its own: 4096 jobs, and /health waited 0.4-0.9 s behind them."""
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["tokens" if path == "/tokenize" else "text"]) == BATCH
    assert 0 < len(jobs) <= MAX_JOBS, len(jobs)


def test_a_4096_prompt_generate_batch_is_a_few_jobs(c, jobs):
    """Every prompt tokenized (and built) before the first is refused: max_new_tokens past the context."""
    body = {"text": [f"hi {i}" for i in range(BATCH)], "sampling_params": {"max_new_tokens": 5000}}
    _error(c.post("/generate", json=body), 400, "sampling_params.max_new_tokens", "context length")
    assert 0 < len(jobs) <= MAX_JOBS, len(jobs)


def test_a_4096_prompt_completions_batch_is_a_few_jobs_and_names_the_prompt(c, jobs):
    """The prompts were tokenized one after another, a job each; the one too long was named `text`."""
    prompts = [f"hi {i}" for i in range(BATCH - 1)] + ["hi " * 3000]
    _error(c.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1}), 400, f"prompt.{BATCH - 1}",
           "context length")
    assert 0 < len(jobs) <= MAX_JOBS, len(jobs)


def test_batch_results_match_single_inputs_and_errors_name_the_index(c):
    """A small batch (one job on a thread) and a larger one (jobs in the worker process) give what each input
    gives alone."""
    small = ["hello", "Grüße 🙂", " ".join(["word"] * 300)]
    large = [f"prompt {i}: " + "lorem ipsum " * (i % 40) for i in range(300)]
    for prompts in (small, large):
        batch = c.post("/tokenize", json={"prompt": prompts}).json()["tokens"]
        assert batch == [c.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
        assert c.post("/detokenize", json={"tokens": batch}).json()["text"] == \
            [c.post("/detokenize", json={"tokens": ids}).json()["text"] for ids in batch]
    long = "hi " * 3000
    _error(c.post("/tokenize", json={"prompt": ["a", "b", long]}), 400, "prompt.2", "context length")
    _error(c.post("/detokenize", json={"tokens": [[1], [99999]]}), 400, "tokens.1", "ids in [0")
    _error(c.post("/generate", json={"text": ["a", long]}), 400, "text.1", "context length")
    _error(c.post("/generate", json={"input_ids": [[1], [99999]]}), 400, "input_ids.1", "token ids")


# ---------------------------------------------------------------- 2. engine errors name the field


@pytest.mark.parametrize("path,body,param,word", [
    ("/v1/completions", {"prompt": [99999], "max_tokens": 1}, "prompt", "[0, "),
    ("/v1/completions", {"prompt": [[1], [99999]], "max_tokens": 1}, "prompt.1", "[0, "),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": 99999}, "top_k", "top_k="),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 5}, "min_tokens", "min_tokens=5"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens", "max_tokens=5000"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "stop_token_ids": [99999]}, "stop_token_ids", ""),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "logit_bias": {"99999": 1}}, "logit_bias", ""),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 5000}, "max_completion_tokens",
     "max_completion_tokens=5000"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "response_format",
     "does not compile"),
    ("/generate", {"input_ids": [99999]}, "input_ids", "[0, "),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len", ""),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 99999}}, "sampling_params.top_k", "top_k="),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"top_k": 99999}]}, "sampling_params.1.top_k", ""),
    ("/generate", {"text": "hi", "lora_path": "nope"}, "lora_path", "LoRA"),
])
def test_engine_errors_name_the_field_as_the_route_spells_it(c, path, body, param, word):
    """These were all `param: null` (or the engine's name: `text`, `max_new_tokens`, `json_schema`)."""
    _error(c.post(path, json=body), 400, param, word)


def test_every_engine_message_is_mapped_to_its_field(engine):
    """Every engine refusal of a request names its field (RequestError.field), which the routes spell as `param`."""
    cases = [
        (dict(input_ids=[99999]), "input_ids"), (dict(input_ids=[]), "input_ids"),
        (dict(input_ids=[1] * (engine.context_len + 1)), "input_ids"), (dict(prompt="a", input_ids=[1]), "input_ids"),
        (dict(input_ids=[1], top_logprobs_num=-1), "top_logprobs_num"),
        (dict(input_ids=[1, 2], logprob_start_len=5), "logprob_start_len"),
        (dict(input_ids=[1], lora_path="x"), "lora_path"),
        (dict(input_ids=[1], sampling_params={"top_k": 99999}), "top_k"),
        (dict(input_ids=[1], sampling_params={"min_new_tokens": 5, "max_new_tokens": 1}), "min_new_tokens"),
        (dict(input_ids=[1], sampling_params={"json_schema": "{}", "regex": "a"}), "regex"),
        (dict(input_ids=[1], sampling_params={"stop_token_ids": [99999]}), "stop_token_ids"),
        (dict(input_ids=[1], sampling_params={"logit_bias": {"99999": 1}}), "logit_bias"),
    ]
    for kwargs, field in cases:
        with pytest.raises(RequestError) as e:
            engine.make_request(**kwargs)
        assert e.value.field == field, (kwargs, str(e.value))


# ---------------------------------------------------------------- 3. grammars that accept nothing


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "ebnf": DEAD}, "ebnf"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "ebnf": DEAD}, "ebnf"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": DEAD}}, "sampling_params.ebnf"),
])
def test_a_grammar_that_accepts_no_token_is_a_400(c, path, body, param, stream):
    """It was a 200 with finish_reason "abort" (a prefill for nothing; OpenAI has no such finish reason)."""
    _error(c.post(path, json=dict(body, stream=stream)), 400, param, "accepts no output")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "ebnf": DEAD_LATER, "temperature": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "ebnf": DEAD_LATER, "temperature": 0}),
])
def test_a_grammar_that_dead_ends_is_the_requests_error_streamed_or_not(c, path, body):
    """Mid-answer the engine fails the request alone ("the sampled token ... does not fit the request's grammar"):
    it was a choice with finish_reason "abort" and the message dropped. Now, as SGLang answers a failed request
    on its OpenAI routes: an error response, or (streamed, the 200 already sent) an error event, never an
    "abort" finish reason."""
    _error(c.post(path, json=body), 400, "ebnf", "GrammarError")
    r = c.post(path, json=dict(body, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    events = _events(r)
    failed = [e for e in events if "error" in e]
    assert len(failed) == 1 and events[-1] is failed[0], events
    assert failed[0]["error"]["code"] == 400 and failed[0]["error"]["param"] == "ebnf", failed
    assert "GrammarError" in failed[0]["error"]["message"]
    assert all(ch.get("finish_reason") != "abort" for e in events for ch in e.get("choices", [])), events


def test_which_aborts_are_errors():
    """Failures (with a status, or the engine's "request failed" / "engine failure" / too large) are errors; the
    server's own aborts (an operator's, shutdown, a client gone) stay finish_reason "abort", as in SGLang."""
    def out(**reason):
        return {"meta_info": {"finish_reason": dict(type="abort", **reason)}}

    grammar = _abort_error(out(message="request failed: GrammarError: the sampled token 0 does not fit"), "x")
    assert grammar is not None and (grammar.status, grammar.param) == (400, "x")
    failure = _abort_error(out(message="engine failure: RuntimeError: boom", status_code=500), "x")
    assert failure is not None and (failure.status, failure.param) == (500, None)
    bug = _abort_error(out(message="request failed: IndexError: injected"), None)
    assert bug is not None and bug.status == 500
    too_large = _abort_error(out(message="KV cache too small for this request"), None)
    assert too_large is not None and too_large.status == 400
    for message in ("aborted by /abort_request", "the server is shutting down", "the client disconnected"):
        assert _abort_error(out(message=message), None) is None
    assert _abort_error({"meta_info": {"finish_reason": {"type": "length", "length": 4}}}, None) is None


# ---------------------------------------------------------------- 4. top_logprobs needs logprobs


def test_top_logprobs_needs_logprobs_true(c):
    """OpenAI: "logprobs must be set to true if this parameter is used"; it was accepted and ignored."""
    for extra in ({}, {"logprobs": False}):
        _error(c.post("/v1/chat/completions", json=dict(messages=USER, max_tokens=1, top_logprobs=2, **extra)), 400,
               "top_logprobs", "logprobs: true")
    ok = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": 2})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    # 0 asks for nothing (a client's default): served, as the server serves every no-op value
    zero = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "top_logprobs": 0})
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None, zero.text
