"""A step's forward and sampling, and the host's work on its tokens: now, or one step later (overlap).

Without overlap a step is launched (forward, sampling) and its sampled ids are read and processed
(appended, stop checks, detokenization, forks, outputs) before the next step is scheduled.

With overlap (SGLang's overlap schedule; `--disable-overlap-schedule` turns it off) the sampled ids
of step N stay on the device: each sampling request carries a placeholder for its new token
(Req.pending, engine/future.py), so the scheduler schedules step N+1 at once and the runner
resolves the placeholders in N+1's input ids on the device. The host launches N+1, then reads
N's ids (copied to pinned memory behind an event) and processes them while the device runs N+1.
A request that ended at step N was computed once more in N+1: that token is dropped, and the KV it
wrote is not kept (Req.finish), so outputs and the prefix cache are those of the plain loop.

A request whose next step needs its last token on the host makes its step synchronous: a grammar
(the next mask), penalties (counts of the output), logprobs (read with the ids). Its batch is then
sampled and processed at once (after the step before, still in flight, is processed). A request
whose output length ends with this token gets no placeholder (it is not scheduled again).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybridmoe.engine.future import HostIds, placeholder
from hybridmoe.engine.request import Req, finish_length
from hybridmoe.engine.sampler import NAN_ROW
from hybridmoe.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from hybridmoe.config import EngineArgs
    from hybridmoe.engine.engine import Engine

OVERLAP_ENV = "HYBRIDMOE_OVERLAP_SCHEDULE"  # 1/0: the default where no flag says (tests run the suite both ways)


def overlap_enabled(args: EngineArgs, device: torch.device) -> bool:
    """--disable-overlap-schedule / --enable-overlap-schedule, else HYBRIDMOE_OVERLAP_SCHEDULE, else on
    for CUDA only (on the CPU the step itself runs on the host thread: nothing to overlap with)."""
    if args.disable_overlap_schedule:
        return False
    if args.enable_overlap_schedule:
        return True
    env = os.environ.get(OVERLAP_ENV, "")
    if env in ("0", "1"):
        return env == "1"
    return device.type == "cuda"


def needs_host_token(req: Req) -> bool:
    """Whether req's next step needs its sampled token on the host first (no overlap for its batch)."""
    p = req.params
    return (req.grammar is not None or req.return_logprob or p.repetition_penalty != 1 or p.frequency_penalty != 0
            or p.presence_penalty != 0)


@dataclass
class Launched:
    """A step whose forward (and sampling) is queued on the device."""

    batch: ScheduledBatch
    sampling: list[Req]  # the requests sampled, in row order
    prefill_only: list[Req]  # max_new_tokens 0: prefilled, nothing sampled
    starts: list[int]  # each batch row's num_computed before the step (a failed step is rolled back)
    prompt_logprobs: list  # (req, entries) computed in the forward, kept once the step is good
    rows: list[tuple | Exception] | None = None  # sampled on the host already (synchronous step)
    host: HostIds | None = None  # or the sampled ids on their way to the host
    slot: int = 0  # ring slot of row 0 (host is not None)
    has_placeholder: list[bool] = field(default_factory=list)  # per row: a placeholder was appended
    done: Any = None  # a step without sampled ids: an event after its work (CUDA), to check it


class StepPipeline:
    """Runs the scheduled batches of an Engine, overlapped or not; owns the step in flight."""

    def __init__(self, engine: Engine, overlap: bool) -> None:
        self.engine = engine
        self.overlap = overlap
        self.inflight: Launched | None = None
        self.overlapped_steps = 0  # steps whose tokens were read after the next step was launched

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def run(self, batch: ScheduledBatch | None) -> list[Req]:
        """Launch batch (None: nothing to run) and process what is due: the step in flight before it,
        then this one unless it stays in flight. Returns the requests updated or finished."""
        updated: list[Req] = []
        launched, error = self._launch(batch) if batch is not None else (None, None)
        prev, self.inflight = self.inflight, None
        if prev is not None:
            updated += self._process(prev, launched)
        if error is not None:
            assert batch is not None
            alone = self.engine._fail_culprit(batch, error)  # nothing of the step launched: the others retry it
            updated += alone if alone is not None else self.engine._fail_batch(live(batch), error)
        elif launched is not None:
            if self.overlap and launched.rows is None:
                self.inflight = launched
                self.overlapped_steps += 1
            else:
                updated += self._process(launched, None)
        return updated

    def flush(self) -> list[Req]:
        """Process the step in flight now (the engine is about to be idle or reconfigured)."""
        return self.run(None) if self.inflight is not None else []

    # ---- launch ----
    def _launch(self, batch: ScheduledBatch) -> tuple[Launched | None, Exception | None]:
        eng = self.engine
        sampling = [r for r, n, s in zip(batch.reqs, batch.num_tokens, batch.sample) if n > 0 and s]
        starts = [r.num_computed for r in batch.reqs]
        try:
            logits = eng.runner.forward(batch)
        except Exception as e:
            return None, e
        # max_new_tokens 0: the prompt is prefilled (its logprobs computed, its pages cached), nothing sampled
        prefill_only = [r for r in sampling if r.params.max_new_tokens == 0]
        if prefill_only:
            keep = [i for i, r in enumerate(sampling) if r.params.max_new_tokens > 0]
            logits = logits[torch.tensor(keep, dtype=torch.long).to(logits.device, non_blocking=True)]
            sampling = [sampling[i] for i in keep]
        step = Launched(batch, sampling, prefill_only, starts, getattr(eng.runner, "prompt_logprobs", []))
        future = eng.runner.future
        # prompt logprobs too: the next chunk's rows follow from the entries this step adds
        sync = not self.overlap or len(sampling) > future.max_rows or any(needs_host_token(r) for r in live(batch))
        if not sync and sampling:
            try:
                step.slot, step.host = future.publish(eng.sampler.sample_ids(logits, sampling))
            except Exception:  # noqa: BLE001  (sampled again below, request by request: the bad one fails alone)
                sync = True
        if sync:
            step.rows = sample_rows(eng.sampler, logits, sampling)
        elif not sampling and logits.is_cuda:  # a prefill chunk: checked (CPU expert errors) once it has run
            step.done = torch.cuda.Event()
            step.done.record()
        eng.scheduler.on_step_done(batch)
        if step.host is not None:
            for i, req in enumerate(sampling):
                last = req.num_sampled + 1 >= req.params.max_new_tokens  # ends by length: not scheduled again
                if not last:
                    req.pending.append(placeholder(step.slot + i))
                step.has_placeholder.append(not last)
        return step, None

    # ---- process ----
    def _process(self, step: Launched, after: Launched | None) -> list[Req]:
        """The host's work on a step's results; `after`: the step launched behind it (failed with it
        when the CPU experts report an error, which may be either's)."""
        eng = self.engine
        try:
            rows = step.rows
            if step.host is not None:
                rows = [_row(t, None, []) for t in step.host.read()]
            elif step.done is not None:
                step.done.synchronize()
            eng.runner.check_step_errors()  # before any token of a failed step is kept
        except Exception as e:
            failed = _rollback(step) + (_rollback(after) if after is not None else [])
            return eng._fail_batch(failed, e)
        rows = rows if rows is not None else []
        for req, entries in step.prompt_logprobs:
            if not req.finished:
                req.input_logprobs.extend(entries)
        eng.step_log.on_step(step.batch.is_decode, len(step.sampling))
        updated = eng._fork(step.batch)
        for req in step.prefill_only:
            if not req.finished:
                eng.scheduler.finish(req, finish_length(0))
                updated.append(eng._retire(req))
        now = time.time()
        for i, (req, row) in enumerate(zip(step.sampling, rows)):
            if req.finished:  # aborted or ended while this step ran: its token is dropped
                continue
            if step.has_placeholder and step.has_placeholder[i]:
                assert req.pending and req.pending[0] == placeholder(step.slot + i), (req.rid, req.pending)
                req.pending.pop(0)
            try:
                if isinstance(row, Exception):
                    raise row
                eng._take_token(req, row, now)
            except Exception as e:  # sampling, detokenization, stop matching: this request alone
                eng._fail_request(req, e)
            updated.append(req)
        return updated


def live(batch: ScheduledBatch) -> list[Req]:
    """The requests of a batch that compute tokens in it and have not ended."""
    return [r for r, n in zip(batch.reqs, batch.num_tokens) if n > 0 and not r.finished]


def _rollback(step: Launched) -> list[Req]:
    """The live requests of a failed step, each one's progress set back to before it (its KV is not
    kept in the prefix cache); the placeholders it appended go when the request ends."""
    for req, n, start in zip(step.batch.reqs, step.batch.num_tokens, step.starts):
        if n > 0 and not req.finished:
            req.num_computed = min(req.num_computed, start)
    return live(step.batch)


def sample_rows(sampler: Any, logits: torch.Tensor, reqs: list[Req]) -> list[tuple | Exception]:  # logits [B, V]
    """Per request (token, logprob, top logprobs), or the exception its sampling raised.

    The batch is sampled at once; if that raises, each request is sampled alone so the one
    whose parameters break the sampler fails without the others.
    """
    if not reqs:
        return []
    try:
        return _rows(sampler(logits, reqs), len(reqs))
    except Exception as e:
        if len(reqs) == 1:
            return [e]
    rows: list[tuple | Exception] = []
    for i, req in enumerate(reqs):
        try:
            rows.extend(_rows(sampler(logits[i:i + 1], [req]), 1))
        except Exception as e:
            rows.append(e)
    return rows


class NonFiniteLogits(RuntimeError):
    """A request's logits hold NaN or +inf: its values blew up (after the CPU experts' last check, or on the GPU)."""

    status_code = 500  # the request's finish reason says so, as a failed forward's does


def _row(token: int, logprob: float | None, top: list) -> tuple | Exception:
    """One request's (token, logprob, top logprobs), or the error of a row the sampler marked NAN_ROW."""
    if token == NAN_ROW:
        return NonFiniteLogits("the model's logits for this request are NaN or infinite (its activations overflowed?)")
    return token, logprob, top


def _rows(out: Any, n: int) -> list[tuple | Exception]:
    return [_row(out.next_ids[i], out.logprobs[i] if out.logprobs is not None else None,
                 out.top_logprobs[i] if out.top_logprobs else []) for i in range(n)]
