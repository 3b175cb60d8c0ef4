"""Structured output: grammars compiled with xgrammar, cached by content, one matcher per request.

A request asks for at most one constraint, named as in SGLang's sampling_params (GRAMMAR_KINDS):
`json_schema` (a JSON Schema, as a JSON string), `regex`, or `ebnf` (xgrammar's EBNF, the GBNF
dialect, root rule `root`). `GrammarBackend.compile` turns one into a CompiledGrammar (thread-safe,
LRU-cached by content, concurrent compiles of the same text done once); `submit` runs it on the
backend's own threads, so the server's event loop never compiles. `RequestGrammar` is the
per-request state: it fills the request's row of the batch's token bitmask (grammar_mask.py) and
advances with each sampled token; the request ends when its matcher terminates (it accepted a
stop token after a complete match).

Legend: V vocabulary (the model's, padded), W = ceil(V / 32) bitmask words.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

try:  # the `structured` extra: xgrammar's wheel requires triton on Linux, which a CPU-only install leaves out
    import xgrammar as xgr
except ImportError:
    xgr = None

from hybridmoe.engine.request import GRAMMAR_FIELDS as GRAMMAR_KINDS

# Whitespace the JSON grammar allows between two elements: enough for pretty printing, bounded so that a
# model stuck on newlines cannot fill max_tokens with them (an unbounded run never parses).
JSON_MAX_WHITESPACE = 32
DEFAULT_CACHE_ENTRIES = 256
NO_XGRAMMAR = ("structured output (response_format, json_schema, regex, ebnf, tool_choice required or named) needs "
               "xgrammar, not installed on this server: pip install 'hybridmoe[structured]'")
DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_COMPILE_THREADS = 2  # grammars compiled at once
# threads xgrammar uses within one compilation (its token masks per grammar state): a quarter of the cores,
# the rest left to the CPU experts; a schema of 60 patterned fields takes seconds over a 150k vocabulary
THREADS_PER_COMPILE = max(1, min(8, (os.cpu_count() or 1) // 4))

# xgrammar's messages start with a log prefix and sometimes a failed-check expression:
# "[16:24:42] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> "Regex parsing error ..."
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false: ")


def drop_inner_anchors(regex: str) -> str:
    """regex without the `^` / `$` anchors xgrammar ignores: outside a character class and not escaped, a
    `^` anywhere but first or a `$` anywhere but last. Its output must match the whole regex, so these are
    redundant or unmatchable, and xgrammar drops them either way; dropped here, it compiles the same grammar
    without printing a line to stderr for each one (outside the server's log; a long regex could print
    thousands, and a JSON schema's pattern is printed whole, newlines and all)."""
    if "^" not in regex and "$" not in regex:
        return regex
    out: list[str] = []
    i, n, in_class = 0, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:  # an escaped character, in a class or not
            out.append(regex[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex.startswith("^", i + 1):  # a negated class: its ^ is not an anchor
                out.append("[^")
                i += 2
                continue
        elif (c == "^" and i > 0) or (c == "$" and i < n - 1):
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _drop_pattern_anchors(node: Any) -> bool:
    """drop_inner_anchors on every string-valued "pattern" of a parsed JSON schema, in place; whether any
    changed."""
    changed = False
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                node[key] = drop_inner_anchors(value)
                changed |= node[key] != value
            else:
                changed |= _drop_pattern_anchors(value)
    elif isinstance(node, list):
        for value in node:
            changed |= _drop_pattern_anchors(value)
    return changed


class GrammarError(ValueError):
    """A grammar that cannot be compiled (or a token it does not accept); the message says why."""


def grammar_of(params: Any) -> tuple[str, str] | None:
    """(kind, text) of the constraint a SamplingParams asks for, or None (validate allows at most one)."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind, None)
        if text is not None:
            return kind, text
    return None


def compiler_message(error: BaseException) -> str:
    """The compiler's own message, without xgrammar's log prefixes; one line per line it had."""
    lines = [_CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", line)).strip() for line in str(error).splitlines()]
    return "; ".join(line for line in lines if line) or type(error).__name__


class GrammarBackend:
    """Compiles grammars for one tokenizer (an xgrammar TokenizerInfo made on first use, off the caller's
    thread when through `submit`) and keeps the compiled ones in an LRU bounded by entries and bytes."""

    def __init__(self, make_info: Callable[[], xgr.TokenizerInfo], cache_entries: int = DEFAULT_CACHE_ENTRIES,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self._make_info = make_info
        self._compiler: xgr.GrammarCompiler | None = None
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.compiles = 0  # compilations done (cache misses), for tests and stats

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: list[int], **kw: Any) -> GrammarBackend:
        """A backend for a Hugging Face tokenizer; vocab_size is the model's (logits' width)."""
        return cls(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                              stop_token_ids=list(stop_ids)), **kw)

    @classmethod
    def for_vocab(cls, vocab: list[str], stop_ids: list[int], vocab_size: int | None = None,
                  **kw: Any) -> GrammarBackend:
        """A backend for a plain vocabulary (token id -> its text): benchmarks and tests."""
        return cls(lambda: xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                             stop_token_ids=list(stop_ids)), **kw)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                # xgrammar's own cache off: this class's LRU is the one cache, with known bounds
                self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=THREADS_PER_COMPILE,
                                                     cache_enabled=False)
            return self._compiler

    def _compile_now(self, kind: str, text: str) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(text)
                except ValueError as e:
                    raise GrammarError(f"json_schema is not valid JSON: {e}") from None
                if _drop_pattern_anchors(schema):
                    text = json.dumps(schema)
                return compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE,
                                                    strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(drop_inner_anchors(text))
            if kind == "ebnf":
                return compiler.compile_grammar(text, root_rule_name="root")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and others) with the parser's message
            raise GrammarError(f"{kind} does not compile: {compiler_message(e)}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        """The compiled grammar (from the cache when the same kind and text were compiled before);
        GrammarError with the compiler's message when it does not compile (errors are not cached)."""
        if xgr is None:
            raise GrammarError(NO_XGRAMMAR)
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            fut = self._inflight.get(key)
            owner = fut is None
            if owner:
                fut = self._inflight[key] = concurrent.futures.Future()
        if not owner:
            return fut.result()  # another thread compiles this text: wait for it (its error too)
        try:
            compiled = self._compile_now(kind, text)
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
            fut.set_exception(e)
            raise
        with self._lock:
            self._inflight.pop(key, None)
            self.compiles += 1
            self._insert(key, compiled)
        fut.set_result(compiled)
        return compiled

    def _insert(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes + len(key[1])
        self._cache[key] = compiled
        self._cached_bytes += size
        while len(self._cache) > self.cache_entries or (self._cached_bytes > self.cache_bytes and len(self._cache) > 1):
            old_key, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.memory_size_bytes + len(old_key[1])

    def submit(self, kind: str, text: str) -> concurrent.futures.Future:
        """compile() on the backend's threads; the future holds the CompiledGrammar or the GrammarError. A cached
        grammar comes back done, never queued behind other compiles; cancelling a queued one drops it."""
        with self._lock:
            hit = self._cache.get((kind, text))
            if hit is not None:
                self._cache.move_to_end((kind, text))
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(hit)
                return done
        return self._executor.submit(self.compile, kind, text)

    def cached(self, kind: str, text: str) -> bool:
        with self._lock:
            return (kind, text) in self._cache

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state: an xgrammar matcher over its compiled grammar. Used by the engine
    thread only (the server makes it, then hands it over with the request)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:  # bitmask [B, W] int32, on the CPU
        """Write the allowed next tokens into bitmask[row] (does not change the state)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance with a sampled token; GrammarError when the grammar does not allow it (the mask was
        not applied, or a stop token was forced past the end)."""
        if not self.matcher.accept_token(token):
            raise GrammarError(f"the sampled token {token} does not fit the request's grammar")

    @property
    def terminated(self) -> bool:
        """The match is complete and a stop token was accepted: the request ends here."""
        return self.matcher.is_terminated()

    def fork(self) -> RequestGrammar:
        """An independent copy at the same state (parallel sampling of one prompt)."""
        new = RequestGrammar.__new__(RequestGrammar)
        new.compiled, new.matcher = self.compiled, self.matcher.fork()
        return new


class EngineGrammars:
    """An engine's structured output: its GrammarBackend, made on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, list(stop_ids)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    @property
    def backend(self) -> GrammarBackend:
        """The backend (cheap to make: xgrammar's tokenizer info is built at its first compile); GrammarError
        for a model without a tokenizer."""
        with self._lock:
            if self._backend is None:
                if self.tokenizer is None:
                    raise GrammarError("structured output (json_schema, regex, ebnf) needs the model's tokenizer")
                self._backend = GrammarBackend.for_tokenizer(self.tokenizer, self.vocab_size, self.stop_ids)
            return self._backend

    def set_backend(self, backend: GrammarBackend) -> None:
        """Use this backend (benchmarks: a model without a tokenizer, a synthetic vocabulary)."""
        self._backend = backend

    def attach(self, req: Any) -> None:
        """Give a request that asks for a grammar, and has none yet, its RequestGrammar, compiling here and
        now (the server compiles on the backend's threads before; this is the offline path)."""
        spec = grammar_of(req.params)
        if spec is not None and req.grammar is None:
            req.grammar = RequestGrammar(self.backend.compile(*spec))
