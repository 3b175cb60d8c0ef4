"""Expert LoRA slots of one CPU engine layer (the native kernels: csrc/lora.h), and the pure-torch
reference of the math.

For a pair (token t, expert e) whose token has slot s = lora_idx[t] >= 0, in the same task as the
base expert:
    g += sc B_g A_g x,  u += sc B_u A_u x   (before the activation)
    y_e += sc B_d A_d h                     (h = act(g) * u; before the routing weight)
with sc = the slot's scaling and x, h unrounded (fp32: the base path's activation quantization
does not touch the low-rank terms).

The slot weights are host tensors owned here, zero padded to the max rank R and the layer's padded
sizes, allocated once: loading or clearing a slot copies into them (never a reallocation), so the
native layer's pointers and a captured CUDA graph's tasks stay valid. Load and clear while no task
of the layer reads that slot (the LoRA manager does it between steps).

Legend: S slots, E the layer's experts (engine order), R max rank, r an adapter's rank, H hidden,
I intermediate, Hp/Ip padded, T tokens, K top-k.
"""

from __future__ import annotations

import ctypes as C

import torch

from hybridmoe.cpu import native
from hybridmoe.cpu.reference import _round_act, activation_fn


class LoraDesc(C.Structure):
    """HmLoraDesc (csrc/lora.h)."""

    _fields_ = [("w", C.c_void_p), ("scale", C.c_void_p), ("rank", C.c_void_p), ("block", C.c_int64)] + [
        (n, C.c_int32) for n in ("slots", "R", "E", "Hp", "Ip", "wdtype")]


def _attach(handle: int, desc: LoraDesc) -> None:
    f = native.lib().hm_layer_attach_lora
    f.restype, f.argtypes = C.c_int, [C.c_void_p, C.POINTER(LoraDesc), C.c_char_p, C.c_int]
    err = C.create_string_buffer(512)
    if f(handle, C.byref(desc), err, len(err)):
        raise ValueError(f"cannot attach LoRA slots: {err.value.decode()}")


class CPULoRASlots:
    """S LoRA slots of rank <= R for a layer's E experts, attached to the native layer `handle`."""

    def __init__(self, handle: int, num_experts: int, hidden: int, inter: int, hidden_pad: int, inter_pad: int,
                 slots: int, max_rank: int, dtype: torch.dtype = torch.bfloat16, what: str = "CPU MoE layer") -> None:
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{what}: LoRA slot weights must be bfloat16 or float32, got {dtype}")
        if slots < 1 or max_rank < 1:
            raise ValueError(f"{what}: LoRA needs at least one slot and rank >= 1 (got {slots}, {max_rank})")
        e, r, hp, ip = num_experts, max_rank, hidden_pad, inter_pad
        self.what, self.E, self.H, self.I, self.R, self.num_slots = what, e, hidden, inter, r, slots
        block = 3 * r * (hp + ip)
        self.w = torch.zeros(slots, e, block, dtype=dtype)  # [S, E, block] (csrc/lora.h layout)
        self.scale = torch.zeros(slots, dtype=torch.float32)  # [S]
        self.rank = torch.zeros(slots, dtype=torch.int32)  # [S] 0: empty
        cuts, o = [], 0
        for n, width in (("ag", hp), ("au", hp), ("bg", ip), ("bu", ip), ("ad", ip), ("bd", hp)):
            part = self.w[:, :, o:o + r * width]
            if n.startswith("b"):  # Bs in 16-column blocks [S, E, width/16, R, 16], seen as [S, E, R, width/16, 16]
                part = part.view(slots, e, width // 16, r, 16).permute(0, 1, 3, 2, 4)
            else:
                part = part.view(slots, e, r, width)  # [S, E, R, width]
            cuts.append((n, part))
            o += r * width
        self.parts = dict(cuts)  # A: [S, E, R, width]; B: [S, E, R, width/16, 16] (views of w)
        self.desc = LoraDesc(self.w.data_ptr(), self.scale.data_ptr(), self.rank.data_ptr(), block, slots, r, e, hp,
                             ip, native.DT_F32 if dtype == torch.float32 else native.DT_BF16)
        _attach(handle, self.desc)

    def nbytes(self) -> int:
        return self.w.nbytes + self.scale.nbytes + self.rank.nbytes

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{self.what}: LoRA slot {slot} out of range [0, {self.num_slots})")
        return slot

    def set_slot(self, slot: int, gate_A: torch.Tensor, gate_B: torch.Tensor, up_A: torch.Tensor, up_B: torch.Tensor,
                 down_A: torch.Tensor, down_B: torch.Tensor, scaling: float) -> None:
        """Loads an adapter: A [E, r, in], B [E, out, r] per gate / up / down (the layer's experts in
        engine order), r <= R."""
        s = self._slot(slot)
        r = gate_A.shape[1] if gate_A.dim() == 3 else -1
        e, h, i = self.E, self.H, self.I
        want = {"gate_A": (e, r, h), "gate_B": (e, i, r), "up_A": (e, r, h), "up_B": (e, i, r), "down_A": (e, r, i),
                "down_B": (e, h, r)}
        got = {"gate_A": gate_A, "gate_B": gate_B, "up_A": up_A, "up_B": up_B, "down_A": down_A, "down_B": down_B}
        for name, t in got.items():
            if tuple(t.shape) != want[name]:
                raise ValueError(f"{self.what}: LoRA {name} must be {list(want[name])}, got {list(t.shape)}")
        if not 1 <= r <= self.R:
            raise ValueError(f"{self.what}: LoRA rank {r} not in [1, max rank {self.R}]")
        self.clear_slot(s)  # rank 0 while copying: a stray reader sees the base expert
        p = self.parts

        def blocked(dst: torch.Tensor, b: torch.Tensor) -> None:  # B [E, out, r] into dst [E, R, out_pad/16, 16]
            bt = torch.zeros(e, self.R, dst.shape[2] * 16, dtype=dst.dtype)
            bt[:, :r, :b.shape[1]] = b.transpose(1, 2)
            dst.copy_(bt.view(dst.shape))

        with torch.no_grad():
            p["ag"][s, :, :r, :h].copy_(gate_A)
            p["au"][s, :, :r, :h].copy_(up_A)
            blocked(p["bg"][s], gate_B)
            blocked(p["bu"][s], up_B)
            p["ad"][s, :, :r, :i].copy_(down_A)
            blocked(p["bd"][s], down_B)
        self.scale[s] = float(scaling)
        self.rank[s] = r

    def clear_slot(self, slot: int) -> None:
        s = self._slot(slot)
        self.rank[s] = 0
        self.scale[s] = 0.0
        self.w[s].zero_()


def check_lora_idx(lora_idx: torch.Tensor | None, t: int, attached: bool) -> torch.Tensor | None:
    """The task's per-token slots as int32 [T] CPU contiguous (None: every token the base model)."""
    if lora_idx is None:
        return None
    if lora_idx.shape != (t,) or lora_idx.device.type != "cpu" or lora_idx.dtype != torch.int32:
        raise ValueError(f"lora_idx must be an int32 CPU tensor [{t}], got {lora_idx.dtype} {tuple(lora_idx.shape)} "
                         f"on {lora_idx.device}")
    if not lora_idx.is_contiguous():
        raise ValueError("lora_idx must be contiguous")
    return lora_idx if attached else None


def moe_lora_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, loras: dict[int, tuple], lora_idx: torch.Tensor | None,
                       activation: str = "silu", skip: torch.Tensor | None = None,
                       act_quant=None) -> torch.Tensor:  # [T, H] float32
    """The CPU engine's LoRA math in float64: loras[slot] = (gate_A, gate_B, up_A, up_B, down_A,
    down_B, scaling) (shapes of CPULoRASlots.set_slot); act_quant rounds the base path's inputs as
    reference.moe_reference does, the low-rank terms use x and h unrounded."""
    t, h = x.shape
    i = down.shape[2]
    act = activation_fn(activation)
    ids = topk_ids.long()
    idx = torch.full((t,), -1, dtype=torch.long) if lora_idx is None else lora_idx.long()
    res = torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        xv = x[tok].float()
        xr = _round_act(xv[None], act_quant)[0]
        for j in range(ids.shape[1]):
            e = int(ids[tok, j])
            if e < 0 or (skip is not None and bool(skip[e])):
                continue
            gu = gate_up[e].double() @ xr  # [2I]
            s = int(idx[tok])
            lo = loras.get(s) if s >= 0 else None
            if lo is not None:
                ga, gb, ua, ub, da, db, sc = lo
                gu[:i] += sc * (gb[e].double() @ (ga[e].double() @ xv.double()))
                gu[i:] += sc * (ub[e].double() @ (ua[e].double() @ xv.double()))
            hv = act(gu[:i], gu[i:]).float()
            y = down[e].double() @ _round_act(hv[None], act_quant)[0]
            if lo is not None:
                y += lo[6] * (lo[5][e].double() @ (lo[4][e].double() @ hv.double()))
            res[tok] += float(topk_weights[tok, j]) * y
    return res.float()
