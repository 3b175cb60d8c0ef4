"""Routed-expert LoRA for the GPU-side experts backends (moe/torch_experts.py gathers the pairs'
slot weights; the fused Triton experts take PairDeltas, whose kernels read them per pair:
triton_expert_ops.py): for a pair (token t, expert e) with slot s = idx[t],
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
        # gate and up in one buffer each (the fused path's kernels take both halves in one launch)
        self.gate_up_A = z(slots, e, 2 * rank, hidden, dtype=dtype, device=device)  # [S, E, 2R, H]
        self.gate_up_B = z(slots, e, 2 * inter, rank, dtype=dtype, device=device)  # [S, E, 2I, R]
        self.gate_A, self.up_A = self.gate_up_A[:, :, :rank], self.gate_up_A[:, :, rank:]  # [S, E, R, H] views
        self.gate_B, self.up_B = self.gate_up_B[:, :, :inter], self.gate_up_B[:, :, inter:]  # [S, E, I, R] views
        self.down_A = z(slots, e, rank, inter, dtype=dtype, device=device)  # [S, E, R, I]
        self.down_B = z(slots, e, hidden, rank, dtype=dtype, device=device)  # [S, E, H, R]
        self.scale = z(slots, dtype=torch.float32, device=device)  # [S]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.gate_A, self.gate_B, self.up_A, self.up_B, self.down_A, self.down_B

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.gate_up_A, self.gate_up_B, self.down_A, self.down_B)) + self.scale.nbytes

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
        come with weight 0: skipped, their deltas never reach the output)."""
        return PairDeltas(self, x, topk_ids)


class PairDeltas:
    """Gate/up deltas [P, 2I] (fp32) before the activation and the down deltas added to the pairs'
    outputs, by the Triton kernels of triton_expert_ops.py (four launches, graph-capturable)."""

    def __init__(self, slots: ExpertLoRASlots, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.slots, self.x, self.top_k = slots, x, topk_ids.shape[1]
        self.ids = topk_ids.reshape(-1).contiguous()  # [P]
        self.idx = slots.batch.index(topk_ids.shape[0])  # [T] int32

    def gate_up(self, weights: torch.Tensor) -> torch.Tensor:  # weights [P] -> [P, 2I] float32
        from hybridmoe.lora.triton_expert_ops import gate_up_deltas

        sl = self.slots
        return gate_up_deltas(self.x, sl.gate_up_A, sl.gate_up_B, sl.scale, self.idx, self.ids, weights, self.top_k)

    def add_down(self, out_pairs: torch.Tensor, act: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """out_pairs [P, H] += w * (the down deltas of the activations act [P, I]), in place."""
        from hybridmoe.lora.triton_expert_ops import add_down_deltas

        sl = self.slots
        return add_down_deltas(out_pairs, act, sl.down_A, sl.down_B, sl.scale, self.idx, self.ids, weights,
                               self.top_k)
