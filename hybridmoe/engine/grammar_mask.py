"""The token bitmask of a batch: filled on the CPU by the requests' matchers, applied to the logits on
their device without a host synchronization.

Legend: B sequences sampled this step, V vocabulary (the model's), W = ceil(V / 32) bitmask words.

Each step the rows of the batch are filled in a CPU buffer (all ones for a request without a grammar),
copied to the device with non_blocking=True from pinned memory, and applied in place by xgrammar's
kernel (Triton on CUDA, C++ on the CPU): the mask never waits for the GPU, and the GPU never waits
for the host beyond the copy it queued. The fill runs while the step's forward (queued before, e.g.
a CUDA-graph replay) still computes. The logits the mask is applied to are the sampler's own copy,
outside any CUDA graph, so decode graphs stay on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# xgr is None without the `structured` extra: then no request has a grammar and nothing here calls it
from hybridmoe.engine.grammar import RequestGrammar, xgr


class BatchBitmask:
    """Buffers for the bitmask of up to any batch size (grown on demand), reused across steps."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        # Two host buffers used in turn: a step's copy may still be queued when the sampler runs again in
        # the same step (the engine re-samples request by request after a failure); the next fill must not
        # overwrite what that copy reads. Across steps the sampler's read of the sampled ids orders them.
        self._host: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._dev: torch.Tensor | None = None

    def _host_rows(self, b: int, device: torch.device) -> torch.Tensor:  # [b, W] int32, CPU
        self._turn ^= 1
        buf = self._host[self._turn]
        if buf is None or buf.shape[0] < b:
            pin = device.type == "cuda"
            buf = torch.empty(max(b, 2 * (buf.shape[0] if buf is not None else 0)), self.words, dtype=torch.int32,
                              pin_memory=pin)
            self._host[self._turn] = buf
        return buf[:b]

    def _device_rows(self, b: int, device: torch.device) -> torch.Tensor:  # [b, W] int32 on device
        dev = self._dev
        # "cuda" (no index) is the current device: compare types, and indices when the caller gives one
        same = dev is not None and dev.device.type == device.type and device.index in (None, dev.device.index)
        if not same or dev.shape[0] < b:
            rows = max(b, 2 * dev.shape[0]) if same else b  # grown geometrically, moved at its needed size
            self._dev = dev = torch.empty(rows, self.words, dtype=torch.int32, device=device)
        return dev[:b]

    def fill(self, grammars: Sequence[RequestGrammar | None], device: torch.device) -> torch.Tensor:
        """The batch's bitmask [B, W] on `device` (queued there without a host sync)."""
        b = len(grammars)
        host = self._host_rows(b, device)
        for i, g in enumerate(grammars):
            if g is not None:
                g.fill(host, i)  # the whole row
            else:
                # every token allowed. Row by row: one fill of a whole batch is large enough for torch to
                # spread it over its OpenMP threads, whose wake-up costs milliseconds on a busy host
                host[i].fill_(-1)
        if device.type == "cpu":
            return host
        return self._device_rows(b, device).copy_(host, non_blocking=True)

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:  # logits [B, V]
        """Set the logits of the tokens each row's grammar forbids to -inf, in place (float32 logits)."""
        mask = self.fill(grammars, logits.device)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[-1]))


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Plain torch: logits [B, V] with bit j of bitmask [B, W] cleared -> -inf (test oracle)."""
    bits = (bitmask[:, :, None].long() >> torch.arange(32, device=bitmask.device)) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
    out = logits.clone()
    out[:, :vocab_size] = out[:, :vocab_size].masked_fill(~allowed, float("-inf"))
    return out
