"""The step loop: requests in, scheduler -> model runner -> sampler -> detokenizer, outputs out.

Thread-safety: `submit`/`abort` may be called from any thread (they go through an inbox that
`step` drains); `step` itself runs on one thread, the one that owns the model.

Isolation: whatever raises for one request (its sampling, penalties, detokenization, stop
matching, output building) ends that request alone with an abort finish_reason carrying the
message; only a failure of the model forward fails the requests of its batch, and the engine then
goes on with the next step.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable
from typing import Any

import torch

from hybridmoe.config import EngineArgs
from hybridmoe.engine import parallel, prompt_logprobs
from hybridmoe.engine.detokenizer import IncrementalDetokenizer
from hybridmoe.engine.grammar import EngineGrammars
from hybridmoe.engine.kv_cache import KVCacheManager
from hybridmoe.engine.model_files import _eos_ids, _load_tokenizer  # noqa: F401  (_load_tokenizer: tests)
from hybridmoe.engine.model_runner import ModelRunner
from hybridmoe.engine.outputs import output_dict
from hybridmoe.engine.pipeline import StepPipeline, overlap_enabled
from hybridmoe.engine.request import (
    Req,
    RequestError,
    SamplingParams,
    SamplingParamsError,
    finish_abort,
    finish_length,
    finish_stop,
    new_rid,
)
from hybridmoe.engine.sampler import Sampler
from hybridmoe.engine.scheduler import ScheduledBatch, Scheduler
from hybridmoe.engine.step_log import StepLog
from hybridmoe.engine.stops import match_stop_str
from hybridmoe.lora.requests import request_lora
from hybridmoe.models.config import model_config
from hybridmoe.weights.loader import load_hf_config

log = logging.getLogger(__name__)


class Engine:
    """Owns the model, the scheduler and the request table."""

    def __init__(self, args: EngineArgs, progress: bool = True) -> None:
        self.args = args
        self.hf_config = load_hf_config(args.model_path, args.trust_remote_code)
        self.model_config = model_config(self.hf_config, f"{args.model_path}/config.json")
        self.tokenizer = _load_tokenizer(args)
        self.runner = ModelRunner(args, self.model_config, progress=progress)
        cache, sched = args.cache_config(), args.scheduler_config()
        self.kv = KVCacheManager(self.runner.num_pages, cache.page_size, enable_prefix_cache=cache.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv, sched.max_running_requests, sched.step_tokens, self.runner.context_len,
                                   schedule_policy=args.schedule_policy)
        self.scheduler.max_loras = args.max_loras_per_batch if self.runner.lora is not None else None
        self.eos_ids = _eos_ids(args.model_path, self.hf_config, self.tokenizer)
        self.sampler = Sampler(self.model_config.vocab_size, self.eos_ids)
        if self.runner.blocking_sync_wanted:  # hybrid on CUDA: a spinning wait takes a CPU experts' core
            self.sampler.wait_event = torch.cuda.Event(blocking=True)
        self.reqs: dict[str, Req] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._fork_of: dict[str, Req] = {}  # rid of a not yet forked sequence (n > 1) -> its first sequence
        self._orphans: list[Req] = []  # forks ended with their first sequence before forking
        self.finished_count = 0
        self.generated_tokens = 0
        self.failed_requests = 0  # ended alone by an error of their own
        self.failed_batches = 0  # model forwards that raised
        self.grammars = EngineGrammars(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        self.step_log = StepLog(self, args.decode_log_interval)
        self.overlap = overlap_enabled(args, self.runner.device)  # --disable-overlap-schedule
        self.pipeline = StepPipeline(self, self.overlap)
        torch.manual_seed(args.random_seed)

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    # ---- requests ----
    def make_request(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | dict | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        lora_path: str | None = None,
    ) -> Req:
        """Validate and tokenize; raises RequestError with a message for the user.

        With sampling_params n > 1 the request carries n - 1 forks (parallel.py), each finishing
        (and reported) under its own rid; with return_logprob and logprob_start_len >= 0 its prompt
        tokens from that position on are scored (prompt_logprobs.py).
        """
        try:
            params = SamplingParams.from_any(sampling_params)
            params.validate(self.hf_config.vocab_size)
        except (SamplingParamsError, TypeError, ValueError, OverflowError) as e:
            raise RequestError(str(e), getattr(e, "field", None)) from e
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of `text` (prompt) and `input_ids`", "input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError("the prompt must be a string", "input_ids")
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send input_ids")
            input_ids = self.tokenizer.encode(prompt)
        assert input_ids is not None
        vocab = self.hf_config.vocab_size
        if not isinstance(input_ids, list):
            raise RequestError(f"input_ids must be a list of token ids in [0, {vocab})", "input_ids")
        if not input_ids:
            raise RequestError("the prompt is empty", "input_ids")
        # The length first: a huge list is refused without walking it.
        if len(input_ids) >= self.context_len and self.args.allow_auto_truncate and input_ids:
            log.warning("request %s: the prompt's %d tokens do not fit the context length %d; keeping the first %d "
                        "(--allow-auto-truncate)", rid or "", len(input_ids), self.context_len, self.context_len - 1)
            input_ids = list(input_ids[:self.context_len - 1])
        if len(input_ids) >= self.context_len:
            raise RequestError(f"the prompt has {len(input_ids)} tokens; the context length is {self.context_len}",
                               "input_ids")
        if not all(type(t) is int and 0 <= t < vocab for t in input_ids):
            raise RequestError(f"input_ids must be a list of token ids in [0, {vocab})", "input_ids")
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise RequestError("top_logprobs_num must be an integer >= 0", "top_logprobs_num")
        if type(logprob_start_len) is not int or not -1 <= logprob_start_len < len(input_ids):
            raise RequestError(f"logprob_start_len must be -1 (no prompt logprobs) or a position in the prompt "
                               f"[0, {len(input_ids)})", "logprob_start_len")
        # Leave room in the context for the generated tokens.
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - len(input_ids))
        req = Req(rid=rid or new_rid(), prompt_ids=list(input_ids), params=params,
                  return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, arrival_time=time.time(),
                  logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs)
        req.lora_name, req.lora_key = request_lora(self.runner.lora, lora_path, RequestError)
        prompt_logprobs.start(req)
        parallel.expand(req)
        return req

    def submit(self, req: Req) -> None:
        """Queue a request (any thread)."""
        self._inbox.put(("add", req))

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        """Abort a request (any thread); it finishes with an abort reason at the next step."""
        self._inbox.put(("abort", (rid, message)))

    def _drain_inbox(self) -> list[Req]:
        ended = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return ended
            if kind == "add":
                req = item
                try:
                    self._register(req)
                    for child in req.forks:
                        self._fork_of[child.rid] = req
                    self.grammars.attach(req)  # a structured-output request not compiled by the server
                    self.scheduler.add(req)  # max_new_tokens 0 too: its prompt is prefilled (and cached)
                except Exception as e:  # this request alone
                    ended.append(self._fail_request(req, e))
            else:
                rid, message = item
                req = self.scheduler.abort(rid, message)
                if req is None and rid in self._fork_of:  # a sequence not forked yet
                    parent = self._fork_of.pop(rid)
                    req = next(c for c in parent.forks if c.rid == rid)
                    parent.forks.remove(req)
                    req.finish(finish_abort(message))
                if req is not None:
                    ended.append(self._retire(req))

    def _register(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self._detok[req.rid] = IncrementalDetokenizer(
            self.tokenizer, req.params.skip_special_tokens, req.params.spaces_between_special_tokens
        ) if self.tokenizer is not None else None

    def _fork(self, batch: ScheduledBatch) -> list[Req]:
        """Fork the sequences of the prompts prefilled in this step (n > 1); those done already."""
        done = []
        for req in batch.reqs:
            if not parallel.ready_to_fork(req) or req.finished:
                continue
            children = parallel.fork(req, self.kv)
            for child in children:
                self._fork_of.pop(child.rid, None)
                self._register(child)
                self.grammars.attach(child)  # a matcher of its own (the compiled grammar comes from the cache)
            for child in [c for c in children if c.params.max_new_tokens == 0]:
                self.kv.release(child.pages, child.all_ids[:child.num_computed], namespace=child.lora_key)  # shared pages back
                child.pages = []
                child.finish(finish_length(0))
                done.append(self._retire(child))
            self.scheduler.add_forked([c for c in children if not c.finished])
        return done

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty() or bool(self._orphans) or self.pipeline.busy

    # ---- the step ----
    def step(self) -> list[Req]:
        """Schedule and run one batch; return the requests that got new tokens or finished. With
        overlap scheduling (pipeline.py) the tokens returned are those of the step before, read
        while this one runs on the device."""
        updated = self._drain_inbox()
        if self._orphans:
            updated, self._orphans = updated + self._orphans, []
        batch = self.scheduler.schedule()
        if batch is not None:
            for req in batch.reqs:
                if req.finished:  # refused or aborted while scheduling
                    updated.append(self._retire(req))
            if not any(n > 0 for n in batch.num_tokens):
                batch = None
        return updated + self.pipeline.run(batch)

    def _take_token(self, req: Req, row: tuple, now: float) -> None:
        token, logprob, top = row
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_ids.append(token)
        self.generated_tokens += 1
        if req.grammar is not None:
            req.grammar.accept(token)  # GrammarError (this request fails alone) if the token breaks it
        if req.return_logprob and logprob is not None:
            req.output_logprobs.append((logprob, token, top))
        self._check_finish(req, token)

    def _fail_request(self, req: Req, error: Exception) -> Req:
        """End one request with an abort carrying the error; its pages go back to the pool."""
        message = f"request failed: {type(error).__name__}: {error}"
        log.warning("request %s failed alone: %s", req.rid, message, exc_info=log.isEnabledFor(logging.DEBUG))
        self.failed_requests += 1
        reason = finish_abort(message)
        if getattr(error, "status_code", None):  # a server-side failure (NonFiniteLogits: 500), as _fail_culprit's
            reason["status_code"] = error.status_code
        self.scheduler.finish(req, reason)  # pages freed if it still held them
        return self._retire(req) if req.rid in self.reqs else req

    def _discard_failed_step(self) -> None:
        hooks = getattr(self.runner, "hooks", None)  # (test doubles of the runner have none)
        if hooks is not None:
            hooks.discard_failed_step()

    def _fail_culprit(self, batch, error: Exception) -> list[Req] | None:
        """The model forward raised before any of its work was kept, naming the token whose own values
        caused it (CPUMoEError.token: a non-finite routing weight, from a request whose activations
        overflowed): end that token's request alone and leave the others of the batch running (their
        progress was not advanced; the next step computes the same tokens again). None when the error
        names no token of a live request: the whole batch fails. CPU device only: on CUDA the CPU experts'
        errors are checked after the step (StepPipeline._process) and may be an earlier step's."""
        token = getattr(error, "token", None)
        if token is None or self.runner.device.type != "cpu":
            return None
        self._discard_failed_step()  # its deferred task's error would fail the retried step
        row = 0
        for req, n in zip(batch.reqs, batch.num_tokens):  # rows in the forward's order (ModelRunner)
            if n <= 0:
                continue
            if row <= token < row + n:
                if req.finished:
                    return None
                others = sum(1 for r, k in zip(batch.reqs, batch.num_tokens) if k > 0 and not r.finished) - 1
                log.error("the model forward failed on a token of request %s; failing it alone, the %d other(s) of "
                          "its batch compute the step again: %s: %s", req.rid, others, type(error).__name__, error)
                self.failed_requests += 1
                self.scheduler.finish(req, dict(finish_abort(f"request failed: {type(error).__name__}: {error}"),
                                                status_code=500))
                return [self._retire(req)]
            row += n
        return None

    def _fail_batch(self, live: list[Req], error: Exception) -> list[Req]:
        """The model forward raised: end the live requests of its batch (pages freed, nothing of
        the step kept); the others, and the next steps, go on."""
        if self.runner.device.type == "cpu":  # nothing of the failed step may fail the next one
            self._discard_failed_step()
        log.error("the model forward failed; failing the %d request(s) of its batch: %s: %s", len(live),
                  type(error).__name__, error, exc_info=error if log.isEnabledFor(logging.DEBUG) else None)
        self.failed_batches += 1
        message = f"engine failure: {type(error).__name__}: {error}"
        for req in live:
            self.scheduler.finish(req, dict(finish_abort(message), status_code=500))
            self._retire(req)
        return live

    def _check_finish(self, req: Req, token: int) -> None:
        p = req.params
        detok = self._detok.get(req.rid)
        new_text = detok.add([token]) if detok is not None else ""
        if detok is not None:
            req.text = detok.text
        n_out = len(req.output_ids)
        reason = None
        if n_out >= p.min_new_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                reason = finish_stop(token)
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason = finish_stop(token)
            elif p.stop_strs and new_text:
                reason = match_stop_str(req, len(new_text))
        if reason is None and req.grammar is not None and req.grammar.terminated:
            reason = finish_stop(token)  # the grammar is complete and took its stop token
        if reason is None and n_out >= p.max_new_tokens:
            reason = finish_length(n_out)
        if reason is not None:
            if detok is not None and reason["type"] == "length":
                detok.flush()
                req.text = detok.text
            self.scheduler.finish(req, reason)
            self._retire(req)

    def _retire(self, req: Req) -> Req:
        if req.forks:  # ended before its prompt was prefilled: its forks end with it
            for child in req.forks:
                self._fork_of.pop(child.rid, None)
                child.finish(dict(req.finish_reason or finish_abort("aborted")))
                child.finished_time = time.time()
                self.finished_count += 1
                self._orphans.append(child)
            req.forks = []
        req.finished_time = time.time()
        self.finished_count += 1
        self.reqs.pop(req.rid, None)
        self._detok.pop(req.rid, None)
        return req

    def run_until_done(self, reqs: Iterable[Req]) -> None:
        pending = {r.rid for r in reqs}
        while pending:
            for r in self.step():
                if r.finished:
                    pending.discard(r.rid)
        if not self.scheduler.has_work() and self._inbox.empty():
            self.pipeline.flush()  # a step of ended requests still in flight (overlap): wait, keep nothing

    # ---- state (engine thread) ----
    def stats(self) -> dict[str, Any]:
        """What the server reports: requests running and queued, KV usage, counters."""
        kv = self.kv
        used = kv.num_used()
        total = kv.num_pages - 1  # page 0 is scratch
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_queue_reqs": len(self.scheduler.waiting),
            "kv_used_pages": used,
            "kv_total_pages": total,
            "page_size": kv.page_size,
            "num_used_tokens": used * kv.page_size,
            "max_total_num_tokens": kv.capacity_tokens,
            "token_usage": used / total if total else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_retracted_reqs": self.scheduler.num_preemptions,
            "cache_hit_rate": (self.scheduler.admitted_cached_tokens / self.scheduler.admitted_prompt_tokens
                               if self.scheduler.admitted_prompt_tokens else 0.0),
            **self.step_log.hybrid,
            "finished_requests": self.finished_count,
            "generated_tokens": self.generated_tokens,
            "failed_requests": self.failed_requests,
            "failed_batches": self.failed_batches,
        }

    def flush_cache(self) -> bool:
        """Forget the prefix cache; False (nothing done) while requests are in flight."""
        if not self.scheduler.has_work() and self._inbox.empty() and not self._orphans:
            self.pipeline.flush()  # a step still in flight holds only requests that ended: nothing to report
        return not self.has_work() and self.kv.reset_prefix_cache()

    def outputs(self, reqs: list[Req]) -> list[tuple[str, dict]]:
        """(rid, output dict) per request; one whose output cannot be built ends with an abort."""
        outs = []
        for req in reqs:
            try:
                # the tokenizer only where needed: output_dict(req) is the form tests replace
                outs.append((req.rid, self.output_dict(req, self.tokenizer) if req.return_text_in_logprobs
                             else self.output_dict(req)))
            except Exception as e:
                self._fail_request(req, e)
                meta = {"id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
                        "completion_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens,
                        "e2e_latency": 0.0}
                outs.append((req.rid, {"text": "", "output_ids": [], "meta_info": meta}))
        return outs

    def shutdown(self) -> None:
        """Write what must outlive the process (the expert distribution statistics)."""
        if self.runner.recorder is not None and self.runner.recorder.path:
            self.runner.recorder.dump()
            log.info("expert distribution written to %s", self.runner.recorder.path)

    # ---- outputs ----
    @staticmethod
    def output_dict(req: Req, tokenizer: Any = None) -> dict:
        """The SGLang-shaped output of a request (tokenizer: for return_text_in_logprobs)."""
        return output_dict(req, tokenizer)

    # ---- scoring (tests, evaluation) ----
    @torch.inference_mode()
    def prompt_logits(self, input_ids: list[int]) -> torch.Tensor:
        """Logits [L, V] (float32, CPU) at every position of a prompt, in one prefill pass."""
        pages = self.kv.allocate(self.kv.pages_for(len(input_ids)))
        if pages is None:
            raise RequestError("not enough free KV cache for scoring now")
        req = Req(rid="score", prompt_ids=list(input_ids), params=SamplingParams(), pages=pages)
        try:
            batch = ScheduledBatch(reqs=[req], num_tokens=[len(input_ids)], sample=[True])
            return self.runner.all_logits(batch).float().cpu()
        finally:
            self.kv.release(pages, [])
