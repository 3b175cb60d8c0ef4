"""Batched sampling: logit bias, grammar masks, penalties, temperature, top-k, top-p, min-p, per-request
seeds, logprobs.

Legend: B sequences sampled this step, V vocabulary.
All work is batched tensor ops on the logits' device; the only host synchronization is the caller
reading the sampled ids (and logprobs when asked). A seeded request draws its noise from a
generator keyed by (seed, step), so its tokens do not depend on what else is in the batch.

logit_bias and structured output (a request's grammar, engine/grammar.py) change the logits first,
on the sampler's own copy: the bias is one index_add of (index, value) tensors copied to the device
once per batch composition; the grammar's token bitmask is filled on the CPU and applied on the
device (grammar_mask.py). Neither waits for the device. Logprobs are those of the distribution after
both (the tokens a grammar forbids have logprob -inf).

A row whose logits hold NaN or +inf (its activations blew up) is sampled as NAN_ROW, on every device and
with no extra host sync: the caller fails that request alone rather than emit the token argmax makes of
NaN (or the 0 that sampling draws from the NaN probabilities of +inf). -inf is a mask, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.cpu.dense import argmax_rows
from hybridmoe.engine.grammar_mask import BatchBitmask
from hybridmoe.engine.request import Req

_NEG_INF = float("-inf")
_INF = float("inf")
LOGPROB_FLOOR = -9999.0
# The id sampled for a row whose logits hold NaN or +inf. Never a token, nor a placeholder (-slot of the overlap
# ring, engine/future.py, whose slots are far fewer); the ring stores 0 in its place (FutureTokens.publish).
NAN_ROW = -(1 << 40)


@dataclass
class SampleOutput:
    next_ids: list[int]  # [B]
    logprobs: list[float] | None  # [B] logprob of the sampled token (raw distribution)
    top_logprobs: list[list[tuple[float, int]]] | None  # [B][N]


class Sampler:
    """Turns last-position logits of a batch into next tokens."""

    def __init__(self, vocab_size: int, stop_ids_always: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = stop_ids_always
        # With CPU experts the step's GPU work waits for the CPU engine's threads: a host thread
        # spinning in a CUDA copy for the whole step takes a core from them (or from the driver's
        # host-function thread). An event made with blocking=True sleeps instead (set by Engine).
        self.wait_event: torch.cuda.Event | None = None
        self.bitmask = BatchBitmask(vocab_size)
        # the logit_bias tensors of the last batch composition: (its requests, flat index [N], bias [N])
        self._bias_reqs: list[Req] = []
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def _ids(self, ids: torch.Tensor) -> list[int]:
        """Sampled ids to the host, after the step's GPU work (sleeping, with wait_event)."""
        if self.wait_event is not None and ids.is_cuda:
            self.wait_event.record()
            self.wait_event.synchronize()
        return ids.tolist()

    def __call__(self, logits: torch.Tensor, reqs: list[Req]) -> SampleOutput:  # logits [B, V]
        next_ids, raw, constrained = self._draw(logits, reqs)
        if raw is None or not any(r.return_logprob for r in reqs):
            return SampleOutput(self._ids(next_ids), None, None)
        lp = torch.log_softmax(raw, dim=-1)
        if constrained:  # a forbidden token's -inf is not JSON: OpenAI's floor for "never" instead
            lp = lp.clamp_min(LOGPROB_FLOOR)
        chosen = lp.gather(1, next_ids.clamp_min(0)[:, None])[:, 0]  # (a NaN row's NAN_ROW: any index)
        n_top = max(r.top_logprobs_num for r in reqs)
        ids_list = self._ids(next_ids)
        top: list[list[tuple[float, int]]] | None = None
        if n_top > 0:
            vals, idx = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
            vals_l, idx_l = vals.tolist(), idx.tolist()
            top = [list(zip(vals_l[b][: r.top_logprobs_num], idx_l[b][: r.top_logprobs_num]))
                   for b, r in enumerate(reqs)]
        return SampleOutput(ids_list, chosen.tolist(), top)

    def sample_ids(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:  # logits [B, V] -> [B]
        """The next ids on the logits' device, not read (overlap scheduling: nothing here waits for the
        device); no logprobs."""
        return self._draw(logits, reqs)[0]

    def _draw(self, logits: torch.Tensor, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """(next ids [B] on the device, NAN_ROW where a row's logits hold NaN or +inf; the float32 logits after
        bias and grammar [B, V] or None on the plain greedy path; whether bias or grammar changed them).
        Queues device work only."""
        constrained = self._constrain(logits, reqs)
        if constrained is not None:
            logits = constrained
        if all(self._plain_greedy(r) for r in reqs):  # one argmax kernel: decode at batch 1 feels every launch
            x = logits[:, : self.vocab_size]
            ids = argmax_rows(x, NAN_ROW) if logits.device.type == "cpu" else None  # (marks the rows itself)
            if ids is None:  # max, not argmax: the same kernel, and its values say which rows hold NaN or +inf
                top, ids = x.max(dim=-1)
                ids = torch.where(top < _INF, ids, NAN_ROW)  # (NaN < inf is False)
            return ids, None, constrained is not None
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        dev = logits.device
        params = [r.params for r in reqs]
        logits = self._apply_penalties(logits, reqs)
        logits = self._mask_min_tokens(logits, reqs)

        greedy = _to(dev, [p.is_greedy for p in params])
        temps = _to(dev, [max(p.temperature, 1e-5) for p in params])
        scaled = logits / temps[:, None]
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1 for p in params) or any(p.min_p > 0 for p in params):
            scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = self._exponential_noise(probs, reqs)
        sampled = torch.argmax(probs / noise, dim=-1)  # exponential race: exact categorical sampling
        ids = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
        return torch.where((raw < _INF).all(dim=-1), ids, NAN_ROW), raw, constrained is not None

    def _constrain(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor | None:  # [B, V] float32
        """Logits with the requests' logit_bias added and their grammars' forbidden tokens at -inf; None
        (nothing to do) when no request of the batch has either."""
        has_bias = any(r.params.logit_bias for r in reqs)
        grammars = [r.grammar for r in reqs]
        has_grammar = any(g is not None for g in grammars)
        if not (has_bias or has_grammar):
            return None
        x = logits[:, : self.vocab_size]
        # the sampler's own copy: the runner's buffers (a CUDA graph's output) are left as they were
        x = x.float() if x.dtype != torch.float32 else x.clone()
        if has_bias:
            idx, val = self._bias_tensors(reqs, x)
            x.view(-1).index_add_(0, idx, val)
        if has_grammar:
            self.bitmask.apply(x, grammars)
        return x

    def _bias_tensors(self, reqs: list[Req], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index [N] into x.view(-1), bias [N]) of the batch's logit_bias entries, rebuilt only when
        the batch's requests change (decode steps of one batch reuse them)."""
        same = len(reqs) == len(self._bias_reqs) and all(a is b for a, b in zip(reqs, self._bias_reqs))
        if same and self._bias is not None and self._bias[0].device == x.device:
            return self._bias
        v = x.shape[1]
        flat, vals = [], []
        for row, r in enumerate(reqs):
            for tid, b in r.params.logit_bias_items:
                flat.append(row * v + tid)
                vals.append(b)
        idx_cpu = torch.tensor(flat, dtype=torch.int64)
        val_cpu = torch.tensor(vals, dtype=torch.float32)
        if x.is_cuda:  # pinned, so the copies are queued without waiting for the device
            idx_cpu, val_cpu = idx_cpu.pin_memory(), val_cpu.pin_memory()
        self._bias = (idx_cpu.to(x.device, non_blocking=True), val_cpu.to(x.device, non_blocking=True))
        self._bias_reqs = list(reqs)
        return self._bias

    @staticmethod
    def _plain_greedy(r: Req) -> bool:
        """Greedy with nothing that changes the logits first (penalties, min_new_tokens) and no
        logprobs: the argmax of the raw logits is the answer."""
        p = r.params
        return (p.is_greedy and not r.return_logprob and p.repetition_penalty == 1 and p.frequency_penalty == 0
                and p.presence_penalty == 0 and r.num_sampled >= p.min_new_tokens)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        params = [r.params for r in reqs]
        if all(p.repetition_penalty == 1 and p.frequency_penalty == 0 and p.presence_penalty == 0 for p in params):
            return logits
        dev, (b, v) = logits.device, logits.shape
        counts = torch.zeros(b, v, device=dev)
        seen = torch.zeros(b, v, dtype=torch.bool, device=dev)
        for i, r in enumerate(reqs):
            p = params[i]
            if p.repetition_penalty == 1 and p.frequency_penalty == 0 and p.presence_penalty == 0:
                continue  # nothing to count (and its sequence may end with an unread placeholder: overlap)
            if r.output_ids:
                out = torch.tensor(r.output_ids, device=dev)
                counts[i].index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            # Repetition penalty (HF/SGLang semantics) covers prompt and output tokens.
            seen[i, torch.tensor(r.all_ids, device=dev)] = True
        rep = _to(dev, [p.repetition_penalty for p in params])[:, None]
        freq = _to(dev, [p.frequency_penalty for p in params])[:, None]
        pres = _to(dev, [p.presence_penalty for p in params])[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - freq * counts - pres * (counts > 0).float()

    def _mask_min_tokens(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        # a request with a grammar stops where its grammar ends: its mask allows the stop tokens only there
        rows = [i for i, r in enumerate(reqs) if r.num_sampled < r.params.min_new_tokens and r.grammar is None]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p = reqs[i].params
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else self.eos_ids)
            banned = [t for t in banned if t < logits.shape[-1]]
            if banned:
                logits[i].index_fill_(0, _to(logits.device, banned), _NEG_INF)
        return logits

    @staticmethod
    def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
        dev, v = logits.device, logits.shape[-1]
        top_k = _to(dev, [p.top_k if p.top_k > 0 else v for p in params])
        top_p = _to(dev, [float(p.top_p) for p in params])
        min_p = _to(dev, [float(p.min_p) for p in params])
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        rank = torch.arange(v, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        # top-p: drop a token when the mass before it already reaches p (the first always stays).
        drop |= (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p[:, None]
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(reqs):
            seed = r.params.sampling_seed
            if seed is not None and not r.params.is_greedy:
                g = torch.Generator(device=probs.device)
                g.manual_seed((seed * 1_000_003 + r.num_sampled) % (1 << 63))
                noise[i] = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g)
        return noise.clamp_min_(1e-20)


def _to(dev: torch.device, values: list) -> torch.Tensor:
    """A small host list as a tensor on dev, copied without waiting for the device (a blocking copy
    would wait for the step's forward and undo overlap scheduling)."""
    t = torch.tensor(values)
    return t if dev.type == "cpu" else t.to(dev, non_blocking=True)
