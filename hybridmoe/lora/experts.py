"""Routed-expert LoRA for the GPU-side experts backends (moe/torch_experts.py; Triton experts
with LoRA attached compute through the same gathered path): for a pair (token t, expert e) with
slot s = idx[t],
    g += s_l B_g[s,e] A_g[s,e] x,  u += s_l B_u[s,e] A_u[s,e] x   (before the activation)
    y += s_l B_d[s,e] A_d[s,e] h                                  (after down)
The slot buffers hold the backend's own experts only (`rows`: their global ids; a hybrid layer's
GPU share), on the device of its weights; fixed tensors, so graphs stay valid across loads.

Legend: n pairs, S slots, E the backend's experts, R max rank, H hidden, I intermediate.
"""

from __future__ import annotations

import torch

from hybridmoe.lora.adapter import ExpertLoRA
from hybridmoe.lora.batch import LoRABatch


class ExpertLoRASlots:
    def __init__(self, rows: torch.Tensor, slots: int, rank: int, hidden: int, inter: int, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.rows = rows.long().cpu()  # [E] global expert ids of the backend's experts
        e = len(self.rows)
        self.batch = batch
        z = torch.zeros
        self.gate_A = z(slots, e, rank, hidden, dtype=dtype, device=device)  # [S, E, R, H]
        self.gate_B = z(slots, e, inter, rank, dtype=dtype, device=device)  # [S, E, I, R]
        self.up_A = z(slots, e, rank, hidden, dtype=dtype, device=device)
        self.up_B = z(slots, e, inter, rank, dtype=dtype, device=device)
        self.down_A = z(slots, e, rank, inter, dtype=dtype, device=device)  # [S, E, R, I]
        self.down_B = z(slots, e, hidden, rank, dtype=dtype, device=device)  # [S, E, H, R]
        self.scale = z(slots, dtype=torch.float32, device=device)  # [S]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.gate_A, self.gate_B, self.up_A, self.up_B, self.down_A, self.down_B

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers()) + self.scale.nbytes

    def set_slot(self, slot: int, lora: ExpertLoRA) -> None:
        self.clear_slot(slot)
        r = lora.rank
        for j, (buf, src) in enumerate(zip(self.buffers(), lora.tensors())):
            part = src[self.rows]  # this backend's experts
            if j % 2 == 0:  # an A [E, r, in]
                buf[slot, :, :r].copy_(part)
            else:  # a B [E, out, r]
                buf[slot, :, :, :r].copy_(part)
        self.scale[slot] = lora.scaling

    def clear_slot(self, slot: int) -> None:
        for buf in self.buffers():
            buf[slot].zero_()
        self.scale[slot] = 0.0

    def pair_slots(self, t: int, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pair: the slot (clamped to 0) and its scale (0 without an adapter). tok [n]."""
        idx = self.batch.index(t).long()[tok]  # [n]
        scale = torch.where(idx >= 0, self.scale[idx.clamp(min=0)], 0.0)  # [n]
        return idx.clamp(min=0), scale

    @staticmethod
    def _delta(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # a [n, R, in], b [n, out, R], v [n, in] -> [n, out]
        va = torch.bmm(a, v.unsqueeze(-1)) * scale.to(v.dtype)[:, None, None]  # [n, R, 1]
        return torch.bmm(b, va).squeeze(-1)

    def gate_up(self, x: torch.Tensor, e: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[n, 2I]: the gate and up deltas of pairs with inputs x [n, H], local experts e [n]."""
        g = self._delta(self.gate_A[slot, e], self.gate_B[slot, e], x, scale)
        u = self._delta(self.up_A[slot, e], self.up_B[slot, e], x, scale)
        return torch.cat([g, u], dim=-1)

    def down(self, h: torch.Tensor, e: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[n, H]: the down delta of pairs with activations h [n, I]."""
        return self._delta(self.down_A[slot, e], self.down_B[slot, e], h, scale)

    def pair_deltas(self, x: torch.Tensor, topk_ids: torch.Tensor) -> PairDeltas:
        """The fused Triton path's hook (moe/triton_moe_kernels.fused_moe): deltas for every pair
        p = t * K + j in routing order. x [T, H], topk_ids [T, K] (local ids; pairs of the other side
        come with weight 0, so their deltas never reach the output)."""
        return PairDeltas(self, x, topk_ids)


_MAX_GATHER = 1 << 25  # gathered adapter elements per chunk of pairs (memory, not speed)


class PairDeltas:
    """Gate/up deltas [P, 2I] before the activation and down deltas [P, H] from the activations, in
    chunks of pairs so a long prefill never gathers more than _MAX_GATHER adapter elements at once."""

    def __init__(self, slots: ExpertLoRASlots, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        t, k = topk_ids.shape
        self.slots, self.x = slots, x
        self.tok = torch.arange(t, device=x.device).repeat_interleave(k)  # [P]
        self.e = topk_ids.reshape(-1).long()  # [P]
        self.slot, self.scale = slots.pair_slots(t, self.tok)  # [P], [P]
        r, h, i = slots.gate_A.shape[2], slots.gate_A.shape[3], slots.down_A.shape[3]
        self.step = max(1, _MAX_GATHER // (r * (2 * h + 3 * i)))

    def _chunks(self):
        for s in range(0, self.e.numel(), self.step):
            yield slice(s, s + self.step)

    def gate_up(self) -> torch.Tensor:  # [P, 2I]
        parts = [self.slots.gate_up(self.x[self.tok[c]], self.e[c], self.slot[c], self.scale[c]) for c in self._chunks()]
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def down(self, act: torch.Tensor) -> torch.Tensor:  # act [P, I] -> [P, H]
        parts = [self.slots.down(act[c], self.e[c], self.slot[c], self.scale[c]) for c in self._chunks()]
        return torch.cat(parts) if len(parts) != 1 else parts[0]
