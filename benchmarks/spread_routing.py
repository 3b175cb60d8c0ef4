"""Benchmark-only routing that reaches every expert, for models with random (`--load-format dummy`) weights.

With random weights the tokens of a prompt route to a few experts past the first layers: the residual stream of
every token takes on a shared direction (each attention output is an average over the prompt), and the router
scores that direction the same for every token. On the Qwen3-30B-A3B shape a 128-token prompt reached 107 of 128
experts in layer 0, then 43 and 39 in layers 1 and 2, the five busiest taking 40-50% of the pairs (session 25).
A trained router spreads the same prompt over nearly all experts, so the all-GPU prefill and large-batch decode
figures of a dummy model understate the expert weights a real one reads.

`install(llm)` adds to each MoE block's router logits a fixed random draw per (row, expert), scaled to dominate
them, at a row offset that a device counter advances on every forward (so decode steps, CUDA-graph replays
included, draw new rows): each token then picks K experts nearly uniformly at random. The routing weights stay a
softmax of the shifted logits. Then the runner's graphs are captured again. Model outputs are meaningless either
way; only the work done is realistic. The CPU-only bf16 decode (cpu/layer_decode.py) routes inside its one native
call per layer and does not see the shift: use it with GPU runs.
"""

from __future__ import annotations

import torch

TABLE_ROWS = 4093  # a prime: the counter's steps (a forward's token count) cycle through every offset


def install(llm, scale: float = 8.0, seed: int = 0) -> int:
    """Wrap every MoE block of `llm`'s model; returns how many. CUDA graphs are captured anew."""
    from hybridmoe.moe.layer import SparseMoEBlock

    runner = llm.engine.runner
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoEBlock)]
    if not blocks:
        return 0
    dev = runner.device
    g = torch.Generator().manual_seed(seed)
    table = (torch.randn(TABLE_ROWS, blocks[0].num_experts, generator=g) * scale).to(dev)  # [N, E]
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    for i, block in enumerate(blocks):
        block.forward_logits = _Spread(block.forward_logits, table, counter, 7919 * (i + 1))
    if runner.graphs is not None:  # the graphs hold the old forward: capture them again
        runner.capture_graphs()
    return len(blocks)


class _Spread:
    """forward_logits(x, logits) with the logits shifted by rows of the table."""

    def __init__(self, inner, table: torch.Tensor, counter: torch.Tensor, stride: int) -> None:
        self.inner, self.table, self.counter, self.stride = inner, table, counter, stride

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:  # [T, H], [T, E]
        t = logits.shape[0]
        rows = (torch.arange(t, device=logits.device) + self.counter * self.stride) % self.table.shape[0]  # [T]
        self.counter.add_(1)  # in place: a graph replay advances it too
        shifted = logits.float() + self.table.index_select(0, rows)  # [T, E]
        return self.inner(x, shifted.to(logits.dtype))
