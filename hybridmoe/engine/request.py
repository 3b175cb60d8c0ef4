"""Requests, sampling parameters (SGLang's field names and defaults) and finish reasons."""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message names it."""


@dataclass
class SamplingParams:
    """Per-request sampling options; names and defaults follow SGLang."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return dataclasses.replace(value)
        if not isinstance(value, dict):
            raise SamplingParamsError(f"sampling_params must be a dict, got {type(value).__name__}")
        value = dict(value)
        if "seed" in value:  # OpenAI spelling
            value.setdefault("sampling_seed", value.pop("seed"))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s) {unknown}")
        return cls(**value)

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first bad field."""

        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", "an integer >= 0")
        need(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens, "min_new_tokens", "an integer >= 0")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "-1 (off) or an integer >= 1")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        need(is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "a number > 0")
        need(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "a number in [-2, 2]")
        need(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "a number in [-2, 2]")
        stop_ok = self.stop is None or isinstance(self.stop, str) or (
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop))
        need(stop_ok, "stop", "a string or a list of non-empty strings")
        ids_ok = self.stop_token_ids is None or (
            isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids)
            and (vocab_size is None or all(t < vocab_size for t in self.stop_token_ids)))
        need(ids_ok, "stop_token_ids", "a list of token ids in the vocabulary")
        need(self.n == 1, "n", "1 (parallel sampling is not supported; send several requests)")
        need(self.sampling_seed is None or is_int(self.sampling_seed), "sampling_seed", "an integer")


class ReqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_rid_counter = itertools.count()


def new_rid() -> str:
    return f"{uuid.uuid4().hex[:16]}{next(_rid_counter)}"


@dataclass
class Req:
    """A generation request as the scheduler sees it: token ids, pages and progress; no tensors."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    # KV cache bookkeeping (owned by the scheduler and kv_cache)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (cached prefix + computed)
    cached_tokens: int = 0  # tokens reused from the prefix cache, reported to the user
    num_shared_pages: int = 0  # leading pages borrowed from the prefix cache (not owned)
    finish_reason: dict | None = None
    # outputs of the detokenizer
    text: str = ""
    output_logprobs: list[tuple[float, int, list[tuple[float, int]]]] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    seed_offset: int = 0  # sampling step counter for per-request seeded generators

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, pos: int) -> int:
        """all_ids[pos] without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def finish(self, reason: dict) -> None:
        self.finish_reason = reason
        self.state = ReqState.FINISHED


def finish_length(n: int) -> dict:
    return {"type": "length", "length": n}


def finish_stop(matched: int | str | None) -> dict:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}
