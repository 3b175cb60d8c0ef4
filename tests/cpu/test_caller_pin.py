"""CPU-only decode steps on the pool leader's CPU (hybridmoe.cpu.caller_pin, off by default): the stepping thread is on
that one CPU for the native calls of each decode step and gets its own mask back after; prefill is never
pinned; the leader's spin is 0 while pinning is on and restored after; outputs equal the unpinned ones
bit for bit; a CPU the process may not use turns pinning off with a warning, not an error.
"""

from __future__ import annotations

import logging
import os

import pytest
from test_layer_moe import GREEDY, _decode, _llm, _prompts, _same

from hybridmoe import envs
from hybridmoe.cpu import caller_pin


class _Pool:
    def __init__(self, cpus: list[int]) -> None:
        self.cpus = cpus
        self.leader_spin_us = 7


def test_pin_moves_the_thread_and_restores_its_mask():
    mask = os.sched_getaffinity(0)
    cpu = max(mask)
    pool = _Pool([cpu, min(mask)])
    pin = caller_pin.CallerPin(pool, True)
    assert pin.enabled and pool.leader_spin_us == 0
    with pin():
        assert os.sched_getaffinity(0) == {cpu}
    assert os.sched_getaffinity(0) == mask and pin.steps == 1
    with pytest.raises(KeyError):  # restored on an error too
        with pin():
            raise KeyError("x")
    assert os.sched_getaffinity(0) == mask
    pin.enabled = False
    assert pool.leader_spin_us == 7  # the spin it found
    with pin():
        assert os.sched_getaffinity(0) == mask
    assert pin.steps == 2


def test_unpinned_pools_and_missing_cpus(caplog):
    assert not caller_pin.CallerPin(_Pool([]), True).enabled
    assert not caller_pin.CallerPin(_Pool([-1]), True).enabled
    pool = _Pool([4095])  # not a CPU of this machine
    pin = caller_pin.CallerPin(pool, True)
    mask = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger="hybridmoe.cpu.caller_pin"):
        with pin():
            assert os.sched_getaffinity(0) == mask
    assert not pin.enabled and pool.leader_spin_us == 7
    assert "CPU 4095" in caplog.text


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(envs.PIN_CALLER, raising=False)
    assert not caller_pin.wanted()
    monkeypatch.setenv(envs.PIN_CALLER, "1")
    assert caller_pin.wanted()
    monkeypatch.setenv(envs.PIN_CALLER, "0")
    assert not caller_pin.wanted()
    monkeypatch.setenv(envs.PIN_CALLER, "yes")
    with pytest.raises(ValueError, match="HYBRIDMOE_PIN_CALLER"):
        caller_pin.wanted()


def test_engine_decode_steps_pinned_and_outputs_unchanged(tmp_path, monkeypatch):
    from tiny_models import make_tiny_model

    monkeypatch.setenv(envs.PIN_CALLER, "1")
    path = make_tiny_model("qwen3_moe", tmp_path / "m", mlp_only_layers=[], num_hidden_layers=3)
    llm = _llm(path, "BF16")
    try:
        runner = llm.engine.runner
        pin, ld = runner.caller_pin, runner.layer_decode
        pool = runner.dense_linears.pool
        assert pin is not None and pin.enabled and pin.cpu == pool.cpus[0]
        assert pool.leader_spin_us == 0
        seen: list[tuple[bool, set[int]]] = []  # (decode?, mask) at each model forward
        model_forward = runner.model.forward

        def spy(input_ids, positions, ctx):
            seen.append((ctx.attn_meta.is_decode, os.sched_getaffinity(0)))
            return model_forward(input_ids, positions, ctx)

        runner.model.forward = spy
        mask = os.sched_getaffinity(0)
        stacked = ld.stack_calls
        pinned = _decode(llm, _prompts(2))
        steps = GREEDY["max_new_tokens"] - 1
        assert ld.stack_calls - stacked == steps  # the stacked call ran pinned
        assert pin.steps == steps
        assert [m for d, m in seen if d] == [{pin.cpu}] * steps
        assert [m for d, m in seen if not d] and all(m == mask for d, m in seen if not d)  # prefill: every CPU
        assert os.sched_getaffinity(0) == mask
        pin.enabled = False
        assert pool.leader_spin_us == -1
        _same(pinned, _decode(llm, _prompts(2)))
        assert pin.steps == steps
    finally:
        llm.shutdown()
