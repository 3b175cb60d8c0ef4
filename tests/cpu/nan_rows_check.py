"""The HmTask.nan_rows check shared by the layer kinds' tests (the CUDA path's tasks): the rows `bad` poisoned
in turn with a NaN input value, an infinite routing weight, a NaN one and a -inf one."""

from __future__ import annotations

import torch

POISONS = [lambda x, w, r: x.__setitem__((r, 3), float("nan")), lambda x, w, r: w.__setitem__((r, 1), float("inf")),
           lambda x, w, r: w.__setitem__((r, 0), float("nan")), lambda x, w, r: w.__setitem__((r, 1), float("-inf"))]


def run_poisoned(layer, pool, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, bad: list[int],
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(out of the poisoned task run with nan_rows, the clean forward's output, the rows not poisoned); asserts the
    poisoned rows are NaN (the task itself must not fail)."""
    ref = layer.forward(x, ids, w)
    xb, wb = x.clone(), w.clone()
    for n, r in enumerate(bad):
        POISONS[n % len(POISONS)](xb, wb, r)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=out_dtype)
    task, keep = layer.make_task(xb, ids, wb, out, nan_rows=True)
    pool.sync(pool.submit(task, keep))
    assert out[bad].isnan().all()
    return out, ref, [r for r in range(x.shape[0]) if r not in bad]
