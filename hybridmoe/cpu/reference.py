"""Pure-torch reference MoE: the test oracle for the CPU kernels and a portable fallback.

Legend: T tokens, K top-k, E experts, H hidden, I intermediate.

    out[t] (+)= sum_j w[t, j] * down_e(act(gate_e x[t]) * up_e x[t]),  e = ids[t, j]

over the token's selected experts that are not skipped (skip[e] true) and have id >= 0.
`act_quant="int8"` reproduces the integer methods' on-the-fly activation quantization (x per
token, the intermediate per token and expert, `quant.quantize_act_int8`), `act_quant="bf16"`
rounds both to bf16 (the AVX-512/AMX BF16 path); the sums themselves are done in float64, so the
difference to a kernel is the kernel's own rounding only.
"""

from __future__ import annotations

import math

import torch

from hybridmoe.cpu.quant import quantize_act_int8


def activation_fn(name: str, alpha: float = 1.702, limit: float = 7.0):
    if name == "silu":
        return lambda g, u: torch.nn.functional.silu(g) * u
    if name in ("gelu", "gelu_tanh"):
        return lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u

    def swiglu_clamp(g, u):
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)

    if name == "swiglu_clamp":
        return swiglu_clamp
    raise ValueError(f"unknown activation {name!r}")


def _round_act(x: torch.Tensor, act_quant: str | None) -> torch.Tensor:
    """x [R, K] fp32 -> the values a kernel actually multiplies (float64)."""
    if act_quant is None:
        return x.double()
    if callable(act_quant):  # a method's own rounding (gguf_quant.act_round_q8k)
        return act_quant(x.float()).double()
    if act_quant == "int8":
        q, s = quantize_act_int8(x.float())
        return q.double() * s.double().unsqueeze(-1)
    if act_quant == "bf16":
        return x.float().to(torch.bfloat16).double()
    raise ValueError(f"unknown act_quant {act_quant!r}")


def moe_reference(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    activation: str = "silu",
    skip: torch.Tensor | None = None,  # [E] bool
    act_quant=None,  # None | "int8" | "bf16" | a callable [R, K] -> rounded values
    out: torch.Tensor | None = None,  # [T, H]; with accumulate=True the result is added to it
    accumulate: bool = False,
) -> torch.Tensor:  # [T, H] float32 (or out's dtype when out is given)
    t, h = x.shape
    e = gate_up.shape[0]
    i = down.shape[2]
    act = activation_fn(activation)
    per_slot = torch.zeros(t, topk_ids.shape[1], h, dtype=torch.float64)  # [T, K, H]: (t, j) pairs are unique
    ids = topk_ids.long()
    valid = ids >= 0
    if skip is not None:
        valid &= ~skip.bool()[ids.clamp(min=0)]
    tok, slot = valid.nonzero(as_tuple=True)
    if tok.numel():
        xr = _round_act(x.float()[tok], act_quant)  # [S, H], one row per (token, expert) pair
        eid = ids[tok, slot]
        w = topk_weights.double()[tok, slot]
        for ex in torch.unique(eid).tolist():
            sel = (eid == ex).nonzero(as_tuple=True)[0]
            hu = xr[sel] @ gate_up[ex].double().T  # [M, 2I]
            a = act(hu[:, :i], hu[:, i:]).float()
            y = _round_act(a, act_quant) @ down[ex].double().T  # [M, H]
            per_slot[tok[sel], slot[sel]] = y * w[sel].unsqueeze(-1)
    res = per_slot.sum(dim=1)  # in j order, like the kernels
    if e == 0:
        raise ValueError("no experts")
    if out is None:
        return res.float()
    if accumulate:
        res += out.double()
    out.copy_(res.to(out.dtype))
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius, float64); 0 when both are zero."""
    num = (out.double() - ref.double()).norm().item()
    den = ref.double().norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    den = ref.double().abs().max().item() if ref.numel() else 0.0
    num = (out.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)
