"""Server limits against a real server on 127.0.0.1: body size (413), prompt length (400 naming the
context length), header/body read timeouts, the connection limit (503), the write timeout of a client
that stopped reading (its request aborted, KV pages freed), client chat templates (refused without the
flag; sandboxed and time-limited with it), /health latency while a 50 MB body and a heavy template are
processed, and the case-insensitive API-key scheme."""

from __future__ import annotations

import json
import random
import socket
import string
import subprocess
import sys
import time

import httpx
import pytest

from hybridmoe.launch_server import serve_main
from hybridmoe.server.limits import LimitsError, ServerLimits

KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONN, HEADER_S, BODY_S, WRITE_S = 12, 1.5, 3.0, 2.0
HEAVY_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def srv(start_server):
    s = start_server("--api-key", KEY, "--max-request-body-size", "64MiB", "--header-timeout", str(HEADER_S),
                     "--body-timeout", str(BODY_S), "--max-connections", str(MAX_CONN), "--write-timeout",
                     str(WRITE_S), "--allow-client-chat-template", "--tokenize-timeout", "4",
                     "--chat-template-timeout", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as client:
        yield client


def _connect(srv, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", srv.port))
    s.settimeout(30)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def _words(n: int) -> str:
    rng = random.Random()
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))


def test_limit_flags_refuse_bad_values(capsys):
    with pytest.raises(LimitsError, match="--header-timeout"):
        ServerLimits(header_timeout=0)
    with pytest.raises(LimitsError, match="--max-connections"):
        ServerLimits(max_connections=-3)
    for argv, flag in ((["--max-connections", "0"], "--max-connections"), (["--write-timeout", "-1"], "--write-timeout"),
                       (["--max-request-body-size", "0"], "--max-request-body-size"),
                       (["--max-top-logprobs-num", "0"], "--max-top-logprobs-num")):
        assert serve_main(["--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err, err


def test_api_key_scheme_is_case_insensitive(srv):
    body = {"text": "Return the", "sampling_params": {"max_new_tokens": 1}}
    for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
        r = httpx.post(srv.url + "/generate", json=body, headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    for header in (f"Basic {KEY}", "bearer wrong", f"bearer{KEY}", KEY, f"bearer {KEY}x"):
        r = httpx.post(srv.url + "/generate", json=body, headers={"Authorization": header})
        assert r.status_code == 401, header


def test_declared_body_too_large_is_413_at_once(srv):
    s = _connect(srv)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
    t0 = time.time()
    status, err = _status_and_json(_read_all(s))
    assert status == 413 and "--max-request-body-size" in err["error"]["message"] and time.time() - t0 < 2
    s.close()


def test_streamed_body_too_large_is_413(c):
    def chunks():  # chunked transfer: no Content-Length, the limit is found while reading
        block = b" " * (1 << 20)
        for _ in range(70):
            yield block

    try:
        r = c.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    except httpx.HTTPError as e:  # the server may close before the client has sent everything
        pytest.fail(f"no 413 answer: {e!r}")
    assert r.status_code == 413 and "--max-request-body-size" in r.json()["error"]["message"]


def test_prompt_too_long_names_the_context_length(c):
    ctx = c.get("/get_model_info").json()["context_length"]
    for path, body in (("/generate", {"text": _words(4 * ctx)}),
                       ("/generate", {"input_ids": [5] * (ctx + 10)}),
                       ("/v1/completions", {"prompt": _words(4 * ctx)}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": _words(4 * ctx)}]}),
                       ("/tokenize", {"prompt": _words(4 * ctx)})):
        r = c.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert f"context length is {ctx}" in r.json()["error"]["message"], (path, r.text)


def _assert_408_after(srv, sent: bytes, limit_s: float, flag: str) -> None:
    """Send `sent` and nothing more: the server answers 408 naming `flag` after about limit_s, and closes."""
    s = _connect(srv)
    s.sendall(sent)
    t0 = time.time()
    raw = _read_all(s)
    waited = time.time() - t0
    s.close()
    assert limit_s * 0.8 < waited < limit_s + 5, waited
    status, err = _status_and_json(raw)
    assert status == 408 and flag in err["error"]["message"]


def test_header_timeout_closes_the_connection(srv):
    for partial in (b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n"):
        _assert_408_after(srv, partial, HEADER_S, "--header-timeout")


def test_body_timeout_is_408_and_closes(srv):
    _assert_408_after(srv, b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"text\": ",
                      BODY_S, "--body-timeout")


def test_connection_limit_gives_503(srv):
    idle = [_connect(srv) for _ in range(MAX_CONN)]
    try:
        probe = _connect(srv)
        probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, err = _status_and_json(_read_all(probe))
        probe.close()
        assert status == 503 and "--max-connections" in err["error"]["message"]
    finally:
        for s in idle:
            s.close()
    deadline = time.time() + 5
    while httpx.get(srv.url + "/health").status_code != 200:
        assert time.time() < deadline
        time.sleep(0.05)


def _server_info(c: httpx.Client) -> dict:
    return c.get("/get_server_info").json()


def test_stalled_streaming_client_is_cut_off_and_its_pages_freed(srv, c):
    before = _server_info(c)["generated_tokens"]
    # top logprobs make each (cumulative) event large, so the socket buffers fill after ~150 tokens
    body = json.dumps({"text": "Return the value", "stream": True, "return_logprob": True,
                       "top_logprobs_num": 20, "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}})
    s = _connect(srv, rcvbuf=4096)
    s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
              f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    assert s.recv(1024).startswith(b"HTTP/1.1 200")  # then read nothing more
    t0 = time.time()
    deadline = t0 + 90
    while True:
        info = _server_info(c)
        if info["num_running_reqs"] == 0 and info["kv_used_pages"] == 0 and info["generated_tokens"] > before:
            break
        assert time.time() < deadline, f"the stalled request still runs: {info}"
        time.sleep(0.2)
    s.close()
    generated = info["generated_tokens"] - before
    assert generated < 1800, "the request ran to its end: it was not aborted"
    assert "--write-timeout" in srv.log()
    print(f"stalled client cut off after {generated} tokens, {time.time() - t0:.1f} s; KV pages freed")


def test_client_chat_template_is_sandboxed(c):
    msgs = [{"role": "user", "content": "hello there"}]
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                              "chat_template_kwargs": {"chat_template": plain}})
    assert r.status_code == 200, r.text
    want = len(c.post("/tokenize", json={"prompt": "hello there", "add_special_tokens": False}).json()["tokens"])
    assert r.json()["usage"]["prompt_tokens"] == want
    for escape in ("{{ messages.__class__.__mro__ }}", "{% set _ = messages.append(1) %}x",
                   "{{ cycler.__init__.__globals__ }}"):
        r = c.post("/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": {"chat_template": escape}})
        assert r.status_code == 400, (escape, r.text)
        assert r.json()["error"]["param"] == "chat_template_kwargs.chat_template"


def test_client_chat_template_refused_without_the_flag(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    assert r.status_code == 400 and "chat_template_kwargs.chat_template" in r.json()["error"]["message"]
    assert "--allow-client-chat-template" in r.json()["error"]["message"]


_POST = """
import json, sys, httpx
url, key, path, body = sys.argv[1], sys.argv[2], sys.argv[3], open(sys.argv[4], "rb").read()
r = httpx.post(url + path, content=body, headers={"Authorization": "Bearer " + key,
               "content-type": "application/json"}, timeout=120)
print(json.dumps({"status": r.status_code, "text": r.text[:2000]}))
"""


def test_health_stays_fast_under_a_50mb_body_and_a_heavy_template(srv, c, tmp_path):
    big = {"text": "word " * 10_000_000, "sampling_params": {"max_new_tokens": 4}}  # 50 MB
    heavy = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": HEAVY_TEMPLATE}}
    normal = {"text": "Return the", "sampling_params": {"max_new_tokens": 8}}
    # The load comes from other processes, so that nothing on the client side (a 50 MB json.dumps or
    # send holding this process's GIL) delays the probes and is blamed on the server.
    procs = {}
    for name, path, body in (("big", "/generate", big), ("heavy", "/v1/chat/completions", heavy),
                             ("normal", "/generate", normal)):
        f = tmp_path / f"{name}.json"
        f.write_bytes(json.dumps(body).encode())
        procs[name] = subprocess.Popen([sys.executable, "-c", _POST, srv.url, KEY, path, str(f)],
                                       stdout=subprocess.PIPE, text=True)
    latencies: list[float] = []
    with httpx.Client(base_url=srv.url, timeout=10) as h:
        h.get("/health")
        while any(p.poll() is None for p in procs.values()):
            t0 = time.perf_counter()
            assert h.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    results = {name: json.loads(p.communicate()[0]) for name, p in procs.items()}
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health under load: {len(latencies)} probes, p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms; slowest {[round(x * 1000) for x in latencies[-5:]]}")
    assert results["big"]["status"] == 400 and "--tokenize-timeout" in results["big"]["text"], results["big"]
    assert results["heavy"]["status"] == 400 and "--chat-template-timeout" in results["heavy"]["text"]
    assert results["normal"]["status"] == 200, results["normal"]
    assert len(latencies) >= 50 and p99 < 0.1, f"/health p99 {p99 * 1000:.1f} ms"
    ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200, "the template workers must be back after the kills"
