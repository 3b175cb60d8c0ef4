"""`--log-requests` lines pair up by rid: a request with n > 1 finishes each sequence under its own rid (X, X-1,
...), so each gets its own Receive line; before, one "Receive: rid=X" line met a Finish line per sequence, and a
grep for rid=X-1 found a Finish with no Receive."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine import parallel
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.server.request_log import finished_line, received_lines
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread

RID = re.compile(r"rid=([\w-]+),")


def _req(n: int) -> Req:
    req = Req(rid="abc", prompt_ids=[5, 9, 14, 3], params=SamplingParams(n=n, max_new_tokens=2, sampling_seed=7))
    parallel.expand(req)  # what Engine.submit does before the request is queued
    return req


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_a_receive_line_per_sequence(level):
    req = _req(3)
    lines = received_lines(req, level)
    assert [RID.search(x).group(1) for x in lines] == ["abc", "abc-1", "abc-2"]
    assert all(x.startswith("Receive: ") and "\n" not in x for x in lines)
    assert lines[0].startswith("Receive: rid=abc, n=3, prompt_tokens=4")  # params.n is 1 once the forks are made
    for i, line in enumerate(lines[1:], 1):
        assert line.startswith(f"Receive: rid=abc-{i}, fork_of=abc, prompt_tokens=4")
        assert "input_ids" not in line  # the prompt is logged once, on the first line
        assert ("sampling_params={" in line) == (level >= 1)
        if level >= 1:  # each fork's own parameters: its seed differs
            assert f"'sampling_seed': {req.forks[i - 1].params.sampling_seed}" in line
    assert ("input_ids=[5, 9, 14, 3]" in lines[0]) == (level >= 2)
    # a grep for one sequence's rid finds its line only ("rid=abc," is not in "rid=abc-1," nor "fork_of=abc,")
    assert [x for x in lines if "rid=abc," in x] == lines[:1]
    assert [x for x in lines if "rid=abc-2," in x] == lines[2:]


def test_one_sequence_is_one_line_as_before():
    lines = received_lines(_req(1), 0)
    assert lines == ["Receive: rid=abc, prompt_tokens=4"]


def test_finish_lines_pair_with_receive_lines():
    req = _req(2)
    outs = [{"meta_info": {"id": r.rid, "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 4,
                           "completion_tokens": 2, "cached_tokens": 0, "e2e_latency": 0.5}, "text": "xy"}
            for r in [req, *req.forks]]
    received = [RID.search(x).group(1) for x in received_lines(req, 0)]
    finished = [RID.search(finished_line(o, 0)).group(1) for o in outs]
    assert received == finished == ["abc", "abc-1"]


@pytest.fixture(scope="module")
def engine():
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    return Engine(EngineArgs(model_path=str(DEMO), device="cpu", chunked_prefill_size=64), progress=False)


def test_a_served_request_with_n_logs_pairs(engine, caplog):
    """Through the server (AsyncEngine.submit logs the Receive lines, its delivery the Finish lines): every rid
    has exactly one Receive and one Finish line."""
    body = {"input_ids": [5, 9, 14, 3], "rid": "pair",
            "sampling_params": {"n": 3, "max_new_tokens": 3, "temperature": 0.8, "ignore_eos": True}}
    with serve_in_thread(lambda args: engine, model_path=str(DEMO), log_requests=True, log_requests_level=1) as url:
        with caplog.at_level(logging.INFO, logger="hybridmoe.requests"):
            r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids = sorted(o["meta_info"]["id"] for o in r.json())
    assert ids == ["pair", "pair-1", "pair-2"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "hybridmoe.requests"]
    for rid in ids:
        mine = [x for x in lines if f"rid={rid}," in x]
        assert [x.split(":")[0] for x in mine] == ["Receive", "Finish"], (rid, lines)
