"""Regressions of a hostile-input audit of the HTTP server: each test failed before its fix.

An in-process server (tests/server/inproc.py: uvicorn with the production protocol and limits, in a thread)
serves the demo model with a small --max-sequences-per-request, so the batch bound is cheap to reach.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.strict import check_unicode
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread

BATCH_LIMIT = 8
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    engine = Engine(EngineArgs(model_path=str(DEMO), device="cpu"), progress=False)
    limits = ServerLimits(max_sequences_per_request=BATCH_LIMIT, tokenizer_workers=1)
    with serve_in_thread(lambda args: engine, limits=limits) as base:
        yield base


@pytest.fixture()
def c(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _error(r: httpx.Response, status: int, param: str | None, word: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert err["code"] == status and body["message"] == err["message"], body
    assert err["param"] == param and word.lower() in err["message"].lower(), body
    return err


# ---------------------------------------------------------------- event-loop stalls


def test_unicode_check_skips_number_lists_at_c_speed():
    """The lone-surrogate check runs on the event loop for every body. It walked every element with a path list
    of its own: 6 s for a 14 MiB `{"input_ids": [1, 1, ...]}` (5M ids), while every other request of the
    server, /health and running streams included, waited. Now lists of numbers (and lists of such lists, a
    batch of ids) are skipped whole: this test's bodies took 5.3 s before, under 0.1 s now (2 cores)."""
    ids = [1] * 3_000_000
    for body in ({"input_ids": ids}, {"input_ids": [ids[:1000]] * 3000}, {"tokens": [1.5, None, True] * 1_000_000}):
        t0 = time.perf_counter()
        check_unicode(body)
        assert time.perf_counter() - t0 < 1.0
    # the check itself is unchanged: every string and key anywhere, named by its path
    for body, where in (({"text": ["ok", "a\ud800"]}, "text.1"), ({"m": [{"c": [1, {"x": "\udfff"}]}]}, "m.0.c.1.x"),
                        ({"k": {"\ud800": 1}}, "k"), ({"ids": [1, 2, "\ud800"]}, "ids.2"), ("\ud800", "body"),
                        ({"ids": [[1], [2, "\ud83d"]]}, "ids.1.1")):
        with pytest.raises(Exception, match="lone surrogate") as e:
            check_unicode(body)
        assert str(e.value).startswith(f"{where}: "), (body, str(e.value))


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": ["a"] * (BATCH_LIMIT + 1)}, "prompt"),
    ("/detokenize", {"tokens": [[5]] * (BATCH_LIMIT + 1)}, "tokens"),
])
def test_tokenize_batches_are_bounded(c, path, body, param):
    """/tokenize and /detokenize took a batch of any size, each input a job of its own off the event loop, whose
    loop-side cost (~0.15 ms) added up: 500,000 one-character prompts (a 2.5 MB body) held the loop, so the
    whole server, for 78 s. Now a batch is bounded by --max-sequences-per-request, as /generate's is."""
    _error(c.post(path, json=body), 400, param, "--max-sequences-per-request")
    key = next(iter(body))
    ok = c.post(path, json={key: body[key][:BATCH_LIMIT]})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["tokens" if path == "/tokenize" else "text"]) == BATCH_LIMIT


# ---------------------------------------------------------------- /dump_expert_distribution_record


def test_dump_path_errors_are_400_not_500(c, tmp_path):
    """A client's `path` that the filesystem refuses was a 500 with a traceback (ValueError: embedded null byte;
    UnicodeEncodeError for a lone surrogate; OSError: File name too long); an existing directory failed after
    the record's temporary file had been written beside it, and left it there."""
    dump = "/dump_expert_distribution_record"
    _error(c.get(dump, params={"path": "a\x00b"}), 400, "path", "NUL")
    r = c.post(dump, content=json.dumps({"path": str(tmp_path / "x\ud800.json")}),
               headers={"content-type": "application/json"})
    _error(r, 400, "path", "lone surrogate")
    target = tmp_path / "is_a_dir"
    target.mkdir()
    _error(c.post(dump, json={"path": str(target)}), 400, "path", "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["is_a_dir"], "no temporary file may be left behind"
    err = _error(c.post(dump, json={"path": str(tmp_path / ("n" * 5000))}), 400, "path", "File name too long")
    assert len(err["message"]) < 400  # the client's path is quoted shortened
    ok = c.post(dump, json={"path": str(tmp_path / "dist.json")})
    assert ok.status_code == 200 and (tmp_path / "dist.json").is_file(), ok.text


def test_dump_path_stays_inside_the_dump_directory(c, tmp_path):
    """Any path the server's user could write was taken: without --api-key any client could overwrite the server's
    own files. Now a client's path must resolve inside the temp directory (no --record-expert-distribution here),
    through "../" and symbolic links alike, and a FIFO there is not replaced."""
    import os
    import tempfile
    from pathlib import Path

    dump = "/dump_expert_distribution_record"
    # beside the temp directory (the repository itself may be inside it: CI clones anywhere)
    outside = Path(tempfile.gettempdir()).resolve().parent / "hybridmoe_never_written.json"
    _error(c.post(dump, json={"path": str(outside)}), 400, "path", "outside")
    _error(c.post(dump, json={"path": f"{tempfile.gettempdir()}/../{outside.name}"}), 400, "path", "outside")
    link = tmp_path / "link.json"
    link.symlink_to(outside)
    _error(c.post(dump, json={"path": str(link)}), 400, "path", "outside")
    assert not outside.exists()
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _error(c.post(dump, json={"path": str(fifo)}), 400, "path", "not a regular file")


# ---------------------------------------------------------------- OpenAI compatibility


def test_assistant_tool_call_message_with_null_content_renders(c):
    """OpenAI's assistant message that made tool calls has `"content": null` (what the SDK hands back for the
    history). It reached the chat template without a content key, and a template indexing message['content']
    (the demo model's, like many) failed: 400 "'dict object' has no attribute 'content'". SGLang renders it as
    "", so does this server now."""
    messages = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    with_empty = c.post("/v1/chat/completions", json={"messages": [dict(m, content=m["content"] or "") for m in messages],
                                                      "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == with_empty.json()["usage"]["prompt_tokens"]


def test_json_parse_error_names_no_param(c):
    """A body that is not JSON had OpenAI's `param` set to the byte offset of the error ("9")."""
    _error(c.post("/generate", content=b'{"text": "a", ', headers={"content-type": "application/json"}), 400, None,
           "not valid JSON")
    _error(c.post("/v1/completions", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"}),
           400, None, "UTF-8")


def test_compressed_body_is_415(c):
    """A gzip body (nothing here decompresses it, so no decompression bomb either) was answered 400 "the body is
    not valid JSON: not UTF-8 (invalid start byte)"; RFC 9110 asks for 415 naming the coding, and
    Accept-Encoding saying what is taken."""
    body = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 1}}).encode()
    r = c.post("/generate", content=gzip.compress(body),
               headers={"content-type": "application/json", "content-encoding": "gzip"})
    _error(r, 415, None, "content-encoding 'gzip'")
    assert r.headers["accept-encoding"] == "identity"
    r = c.post("/generate", content=body, headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text


# (the routes taking GET and POST have one operation id for both: FastAPI warns when the schema is built)
@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")
def test_head_is_answered_where_get_is(c):
    """HEAD /health (what load balancers and uptime monitors send) was 405 on every route: FastAPI's routes take
    only their declared methods, and RFC 9110 asks a server taking GET to take HEAD. Routes that change state
    (GET and POST: /flush_cache) still refuse it."""
    for path in ("/health", "/v1/models", "/get_model_info", "/get_server_info"):
        r = c.head(path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    r = c.head("/flush_cache")
    # (Starlette lists a route's methods from a set: their order differs between processes)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}, r.headers
    assert c.head("/generate").status_code == 405
    ops = c.get("/openapi.json").json()["paths"]
    assert not any("head" in methods for methods in ops.values()), "HEAD twins stay out of the schema"
