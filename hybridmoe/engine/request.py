"""Requests, sampling parameters (SGLang's field names and defaults) and finish reasons."""

from __future__ import annotations

import dataclasses
import itertools
import math
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Documented ranges (SGLang's): temperature >= 0 (capped where sampling is uniform anyway),
# repetition_penalty in (0, 2], frequency/presence penalties in [-2, 2].
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 2.0
MAX_FREQUENCY_PENALTY = 2.0
# Stop strings are matched at every step and held back from streams: bounded so that matching stays cheap.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MAX_STOP_TOKEN_IDS = 256
# logit_bias: OpenAI's range of a bias; the number of entries bounded so the per-step scatter stays small.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 4096
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # structured output: at most one (engine/grammar.py)
# Parallel samples per prompt (n); the server's --max-n-samples bounds it further.
MAX_N = 1024


class RequestError(ValueError):
    """A request that cannot be served as given (the server answers 400). `field`: the request field at fault,
    by the engine's (SGLang's native) name (`input_ids` for the prompt, a sampling parameter, `top_logprobs_num`,
    `logprob_start_len`, `lora_path`); None when no one field is. (Here, not in engine.py, so that the command
    line's error report knows it without importing torch.)"""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message names it, `field` too (None: no one field)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


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
    # structured output (engine/grammar.py): a JSON Schema as a JSON string, a regex, or xgrammar EBNF
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # token id (an int, or its decimal string as in OpenAI's JSON) -> bias added to its logit, in [-100, 100]
    logit_bias: dict[str, float] | dict[int, float] | None = None

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
    def logit_bias_items(self) -> list[tuple[int, float]]:
        """(token id, bias) pairs of logit_bias (validated first), one per id, the last given winning."""
        if not self.logit_bias:
            return []
        return list({int(k): float(v) for k, v in self.logit_bias.items()}.items())

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None, context_len: int | None = None) -> None:
        """Raise SamplingParamsError naming the first bad field.

        Strict: integers are ints (not bools or floats) within int64, numbers are finite, flags are
        bools, strings are valid Unicode; the ranges are SGLang's documented ones. With vocab_size,
        top_k and stop_token_ids must fit the vocabulary; with context_len, max_new_tokens must fit
        the context. Nothing out of range may reach torch (a huge int overflows a tensor).
        """

        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                shown = repr(getattr(self, name))
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise SamplingParamsError(f"{name}={shown} is invalid: expected {expected}", name)

        def int_in(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            need(is_int(v) and lo <= v <= hi, name, f"an integer in [{lo}, {hi}]")

        def num_in(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            # int bounds are compared exactly: float() of a huge int would overflow
            ok = is_num(v) and (not isinstance(v, float) or math.isfinite(v)) and (lo < v if lo_open else lo <= v)
            need(ok and v <= hi, name, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")

        most_tokens = context_len if context_len is not None else INT64_MAX
        int_in("max_new_tokens", 0, most_tokens)
        int_in("min_new_tokens", 0, INT64_MAX)
        need(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
             f"at most max_new_tokens={self.max_new_tokens}")
        num_in("temperature", 0, MAX_TEMPERATURE)
        num_in("top_p", 0, 1, lo_open=True)
        top_k_max = vocab_size if vocab_size is not None else INT64_MAX
        need(is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= top_k_max), "top_k",
             f"-1 (off) or an integer in [1, {top_k_max}]")
        num_in("min_p", 0, 1)
        num_in("repetition_penalty", 0, MAX_REPETITION_PENALTY, lo_open=True)
        num_in("frequency_penalty", -MAX_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY)
        num_in("presence_penalty", -MAX_FREQUENCY_PENALTY, MAX_FREQUENCY_PENALTY)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        stop_ok = stops is None or (isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS and all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS and is_unicode(s) for s in stops))
        need(stop_ok, "stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings of "
                              f"at most {MAX_STOP_CHARS} characters (valid Unicode)")
        id_end = vocab_size if vocab_size is not None else INT64_MAX
        ids_ok = self.stop_token_ids is None or (
            isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
            and all(is_int(t) and 0 <= t < id_end for t in self.stop_token_ids))
        need(ids_ok, "stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in [0, {id_end})")
        for flag in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            need(isinstance(getattr(self, flag), bool), flag, "true or false")
        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]")
        self._validate_structured(need, id_end)
        need(self.sampling_seed is None or (is_int(self.sampling_seed) and INT64_MIN <= self.sampling_seed
                                            <= INT64_MAX), "sampling_seed", "an integer within int64")


    def _validate_structured(self, need: Any, id_end: int) -> None:
        """The grammar fields (at most one, each a non-empty string) and logit_bias."""
        for name in GRAMMAR_FIELDS:
            v = getattr(self, name)
            need(v is None or (isinstance(v, str) and v != "" and is_unicode(v)), name, "a non-empty string")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingParamsError(f"{' and '.join(given)} are both given: a request takes at most one "
                                      f"structured-output constraint ({', '.join(GRAMMAR_FIELDS)})", given[1])
        bias = self.logit_bias
        ok = bias is None or (isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS_ENTRIES and all(
            _token_key(k, id_end) and is_num(v) and (not isinstance(v, float) or math.isfinite(v))
            and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for k, v in bias.items()))
        need(ok, "logit_bias", f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} entries token id (in [0, {id_end})) "
                               f"-> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")


def _token_key(k: object, id_end: int) -> bool:
    """A logit_bias key: a token id as an int or its decimal string (OpenAI's JSON keys), within the vocabulary."""
    if isinstance(k, str):
        if not (k.isascii() and k.isdigit() and len(k) <= 19):
            return False
        k = int(k)
    return is_int(k) and 0 <= k < id_end  # type: ignore[operator]


def is_int(v: object) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_unicode(s: str) -> bool:
    """False for a str holding lone surrogates (JSON's "\\ud800"), which cannot be encoded as UTF-8."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    admit_time: float | None = None  # first admitted to the running set (queue time = admit - arrival)
    finished_time: float | None = None
    num_preemptions: int = 0
    seed_offset: int = 0  # sampling step counter for per-request seeded generators
    grammar: Any = None  # structured output: its RequestGrammar (engine/grammar.py), made before it runs
    # prompt logprobs (prompt_logprobs.py): from logprob_start_len (-1: none) on; entries
    # (logprob or None, token id, top [(logprob, id)] or None), the first one None (nothing before it)
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    input_logprobs: list[tuple[float | None, int, list[tuple[float, int]] | None]] = field(default_factory=list)
    # n > 1 (parallel.py): the other n-1 sequences, forked from this one once its prompt is prefilled
    forks: list[Req] = field(default_factory=list)
    sample_index: int = 0  # which of the n sequences of its prompt this is
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_key: str | None = None  # that adapter's load (name#n): its prefix cache namespace
    # Overlap scheduling (engine/pipeline.py): tokens sampled on the device whose values the host has
    # not read yet, as placeholders -slot (engine/future.py); they follow output_ids in the sequence,
    # so the scheduler schedules the next step before the host knows them. At most one step's worth.
    pending: list[int] = field(default_factory=list)
    # Output entries already formatted (engine/formatted.py): engine-thread only, each fork its own.
    output_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def all_ids(self) -> list[int]:
        """Prompt, output and pending placeholder ids: the sequence whose KV the steps compute."""
        return self.prompt_ids + self.output_ids + self.pending if self.pending else self.prompt_ids + self.output_ids

    def ids_between(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] (0 <= start <= stop) without building the whole list: a decode step reads one
        token of a sequence that may be tens of thousands long."""
        p, o = self.prompt_ids, self.output_ids
        n, m = len(p), len(o)
        out = p[start:stop] if start < n else []
        if stop > n and start < n + m:
            out += o[max(start - n, 0):stop - n]
        if stop > n + m and self.pending:
            out += self.pending[max(start - n - m, 0):stop - n - m]
        return out

    def token_at(self, pos: int) -> int:
        """all_ids[pos] without building the list."""
        n, m = len(self.prompt_ids), len(self.output_ids)
        if pos < n:
            return self.prompt_ids[pos]
        return self.output_ids[pos - n] if pos < n + m else self.pending[pos - n - m]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending)

    @property
    def num_sampled(self) -> int:
        """Tokens sampled so far, read on the host or pending: the output index of the next one."""
        return len(self.output_ids) + len(self.pending)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def finish(self, reason: dict) -> None:
        if self.pending:  # overlap: the step after the end was launched before the end was seen; what it
            self.pending.clear()  # computed (the KV of the last kept token) is dropped, as without overlap
            self.num_computed = min(self.num_computed, max(0, self.seq_len - 1))
        self.finish_reason = reason
        self.state = ReqState.FINISHED


def finish_length(n: int) -> dict:
    return {"type": "length", "length": n}


def finish_stop(matched: int | str | None) -> dict:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}
