"""server/worker_main.run_job, the tokenizer workers' jobs, called in-process on the demo model's tokenizer."""

from __future__ import annotations

import logging

import pytest
import transformers

from hybridmoe.config import DEMO_MODEL_PATH
from hybridmoe.server.worker_main import run_job


@pytest.fixture
def tok():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)  # fresh: its one-time warnings unsent


@pytest.mark.parametrize("job", ["encode", "chat"])
def test_a_prompt_past_the_model_length_prints_nothing(tok, job, capfd, caplog):
    """transformers logs "Token indices sequence length is longer than ..." once per tokenizer for such a text,
    outside the server's log format; the server's own 400 names the context length."""
    text = "hello " * (tok.model_max_length + 50)
    caplog.set_level(logging.WARNING)
    if job == "encode":
        kind, n = run_job(tok, ("encode", text, True, tok.model_max_length))
    else:
        kind, n = run_job(tok, ("chat", None, [{"role": "user", "content": text}], True, False, {}, tok.model_max_length))
    out, err = capfd.readouterr()
    assert kind == "too_long" and n > tok.model_max_length
    assert "sequence length" not in out + err and not [r for r in caplog.records if "sequence length" in r.message]
    assert run_job(tok, ("encode", "hello", True, None)) == ("ids", tok.encode("hello"))
