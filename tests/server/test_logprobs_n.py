"""Prompt logprobs (lm-evaluation-harness's loglikelihood requests, SGLang's sgl.select sequence) and
n > 1 against a real server on the demo model, with references computed by transformers (fp32)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.server.conftest import DEMO

CHOICES = [" red", " a small green frog", " blue", " the"]
PREFIX = "Once upon a time, in a land far away, there lived a king whose favourite colour was"


@pytest.fixture(scope="module")
def srv(start_server):  # small chunks and pages: prompts span several of each
    return start_server("--chunked-prefill-size", "16", "--page-size", "8", "--max-n-samples", "8")


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(DEMO))


def _ref_logprobs(ref, ids: list[int]) -> list[float]:
    """log p(ids[p] | ids[:p]) for p >= 1."""
    with torch.no_grad():
        lp = torch.log_softmax(ref[0](torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def _loglikelihood(http, text: str) -> dict:
    """The request lm-evaluation-harness's local-completions model sends for loglikelihood."""
    r = http.post("/v1/completions", json={"model": "default", "prompt": text, "max_tokens": 0, "echo": True,
                                           "logprobs": 1, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_equal_transformers_loglikelihood(http, ref):
    text = PREFIX + " a small green frog"
    ids = ref[1].encode(text)
    assert len(ids) > 16  # several prefill chunks
    want = _ref_logprobs(ref, ids)
    for attempt in range(2):  # the second one hits the prefix cache the first one filled
        body = _loglikelihood(http, text)
        choice = body["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == ref[1].decode(ids)
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1:]
        assert abs(sum(got) - sum(want)) < 1e-4, attempt
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)


def test_generate_input_token_logprobs_equal_transformers(http, ref):
    ids = ref[1].encode(PREFIX)
    want = _ref_logprobs(ref, ids)
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                     "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert got[0][0] is None and [t for _, t, _ in got] == ids
    assert abs(sum(x[0] for x in got[1:]) - sum(want)) < 1e-4
    assert [x[2] for x in got] == [ref[1].decode([t]) for t in ids]  # return_text_in_logprobs
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert len(meta["output_token_logprobs"]) == 2 and meta["output_token_logprobs"][0][2] is not None


def test_sgl_select_request_sequence_picks_the_reference_choice(http, ref):
    """What SGLang's RuntimeEndpoint.select sends: the prefix with max_new_tokens 0 (prefill and
    cache it), then every prefix + choice from two tokens before the prefix's end, with
    return_logprob and text, max_new_tokens 0; the choice of the highest token-length-normalized
    prompt logprob wins."""
    sampling = {"max_new_tokens": 0, "temperature": 0}
    r = http.post("/generate", json={"text": PREFIX, "sampling_params": sampling})
    assert r.status_code == 200, r.text
    prompt_len = r.json()["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 2, 0)
    r = http.post("/generate", json={"text": [PREFIX + c for c in CHOICES], "sampling_params": sampling,
                                     "return_logprob": True, "return_text_in_logprobs": True,
                                     "logprob_start_len": start})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == len(CHOICES)
    assert all(0 < o["meta_info"]["cached_tokens"] <= start for o in outs)  # the prefix's pages, up to start
    normalized = []
    for out in outs:
        lps = [x[0] for x in out["meta_info"]["input_token_logprobs"] if x[0] is not None]
        normalized.append(sum(lps) / len(lps))
        assert abs(out["meta_info"]["normalized_prompt_logprob"] - normalized[-1]) < 1e-6
    want = []
    for c in CHOICES:
        ids = ref[1].encode(PREFIX + c)
        lps = _ref_logprobs(ref, ids)[start:]  # the tokens after position `start`
        want.append(sum(lps) / len(lps))
    assert max(abs(a - b) for a, b in zip(normalized, want)) < 1e-4
    assert normalized.index(max(normalized)) == want.index(max(want))


def test_completions_n_reproducible_with_a_seed(http):
    body = {"model": "default", "prompt": "The weather today", "max_tokens": 8, "n": 4, "temperature": 1.0,
            "seed": 42, "ignore_eos": True}
    a = http.post("/v1/completions", json=body).json()
    b = http.post("/v1/completions", json=body).json()
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert texts == [c["text"] for c in b["choices"]]
    assert len(set(texts)) > 1
    prompt = a["usage"]["prompt_tokens"]
    assert a["usage"]["completion_tokens"] == 32 and a["usage"]["total_tokens"] == prompt + 32
    c = http.post("/v1/completions", json=dict(body, seed=None)).json()
    assert [x["text"] for x in c["choices"]] != texts


def test_n_on_chat_generate_and_streams(http):
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3,
            "temperature": 1.0, "seed": 3, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 15
    gen = http.post("/generate", json={"text": "abc", "sampling_params": {"n": 2, "max_new_tokens": 3,
                                                                          "ignore_eos": True}})
    assert gen.status_code == 200 and len(gen.json()) == 2
    batch = http.post("/generate", json={"text": ["abc", "de"], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert [o["meta_info"]["prompt_tokens"] for o in batch.json()][::2] == [o["meta_info"]["prompt_tokens"]
                                                                          for o in batch.json()][1::2]
    assert len(batch.json()) == 4
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 4, "n": 2, "ignore_eos": True})):
        with http.stream("POST", path, json=dict(body, stream=True, stream_options={"include_usage": True})) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        indexes = {c["index"] for e in events for c in e["choices"]}
        assert indexes == set(range(body["n"]))
        finished = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
        assert sorted(c["index"] for c in finished) == list(range(body["n"]))
        assert events[-1]["usage"]["completion_tokens"] == body["n"] * (5 if path.endswith("chat/completions") else 4)
    with http.stream("POST", "/generate", json={"text": "abc", "stream": True,
                                                "sampling_params": {"n": 2, "max_new_tokens": 2}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert {e["index"] for e in events} == {0, 1}


def test_generate_batch_takes_logprob_options_per_prompt(http, ref):
    """SGLang's batch form: return_logprob, top_logprobs_num and logprob_start_len as one list entry per prompt."""
    texts = [PREFIX, PREFIX + " and a frog", "A third prompt"]
    ids = [ref[1].encode(t) for t in texts]
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                     "return_logprob": [True, True, False], "top_logprobs_num": [0, 3, 0],
                                     "logprob_start_len": [0, 4, 0]})
    assert r.status_code == 200, r.text
    outs = r.json()
    first, second = outs[0]["meta_info"], outs[1]["meta_info"]
    want = _ref_logprobs(ref, ids[0])
    assert [t for _, t, _ in first["input_token_logprobs"]] == ids[0]
    assert abs(sum(x[0] for x in first["input_token_logprobs"][1:]) - sum(want)) < 1e-4
    assert [t for _, t, _ in second["input_token_logprobs"]] == ids[1][4:]  # from position 4 on
    assert second["input_token_logprobs"][0][0] is None
    want2 = _ref_logprobs(ref, ids[1])[4:]  # log p(ids[p] | ids[:p]) for p >= 5
    assert abs(sum(x[0] for x in second["input_token_logprobs"][1:]) - sum(want2)) < 1e-4
    assert len(second["input_top_logprobs"][1]) == 3
    assert "input_token_logprobs" not in outs[2]["meta_info"] or not outs[2]["meta_info"]["input_token_logprobs"]


@pytest.mark.parametrize("body,needle", [
    ({"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [0]}, "logprob_start_len has 1 entries"),
    ({"text": "a", "return_logprob": [True]}, "return_logprob is a list, but the request has one prompt"),
    ({"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": [1, 10**6]}, "top_logprobs_num"),
])
def test_generate_per_prompt_logprob_options_checked(http, body, needle):
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and needle in r.text, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "n": 9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 9}),
    ("/generate", {"text": "x", "sampling_params": {"n": 9}}),
    ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": 1000}),
])
def test_limits_give_400(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text


def test_official_openai_client_n_and_echo_logprobs(srv, ref):
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model="default", prompt="The weather today", max_tokens=6, n=4, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 4 and [c.text for c in a.choices] == [c.text for c in b.choices]
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], n=4,
                                          max_tokens=4, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2, 3]
    text = PREFIX + " blue"
    r = client.completions.create(model="default", prompt=text, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    ids = ref[1].encode(text)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert abs(sum(lp.token_logprobs[1:]) - sum(_ref_logprobs(ref, ids))) < 1e-4
