"""Packed expert weights (the CPU engine's block layout, quant.py) -> dense weights, on any device.

Device-agnostic torch with the reference's fp32 arithmetic (quant.py), so a GPU dequantizes the
CPU-resident experts exactly as the CPU oracle does (layerwise prefill, dynamic expert update).

Legend: c experts in a call, E experts of a layer, H hidden, I expert intermediate, N output rows
and K reduction size of a packed matrix, G int4 group size; "p" padded sizes of the packed layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.cpu.quant import PackedLayer

DEQUANT_CHUNK_ELEMS = 1 << 25  # padded matrix elements dequantized at a time (bounds the temporaries)


@dataclass(frozen=True)
class PackedFormat:
    """What the dequantization needs to know about a packed layer besides its tensors."""

    method: str
    hidden: int
    inter: int
    hidden_pad: int
    inter_pad: int
    group_size: int

    @classmethod
    def of(cls, p: PackedLayer) -> PackedFormat:
        return cls(p.method.upper(), p.hidden, p.inter, p.hidden_pad, p.inter_pad, p.group_size)


def packed_parts(p: PackedLayer) -> dict[str, torch.Tensor]:
    """The tensors the dequantization reads ("w13.data", "w13.scale", ...), each [E, ...] with one
    expert per row (the int8 row sums are not needed)."""
    out = {}
    for name, m in (("w13", p.w13), ("w2", p.w2)):
        for part in ("data", "scale", "zero"):
            t = getattr(m, part)
            if t is not None:
                out[f"{name}.{part}"] = t
    return out


def dequantize_packed(
    data: torch.Tensor,  # uint8 [c, bytes per expert]
    scale: torch.Tensor | None,  # int8: f32 [c, N]; int4: f32 [c, N/16, K/G, 16]; fp8: f32 [c, N/16, K/G]
    zero: torch.Tensor | None,  # int4 asymmetric: f32 [c, N/16, K/G, 16]
    method: str,
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [c, n, k] (padded), dtype
    """Packed block layout -> dense rows, with the reference's fp32 arithmetic (quant.py) rounded
    once to `dtype`: int8 s[n] * q, int4 (d * u) + m (m = -8 d when symmetric), bf16 as is, fp8
    (streamed as its bytes) fp8 * s of its 16-row block and K group."""
    c, nb = data.shape[0], n // 16
    out = torch.empty(c, n, k, dtype=dtype, device=data.device)
    if method == "AMXINT8":
        q = data.view(torch.int8).view(c, nb, k // 4, 16, 4).permute(0, 1, 3, 2, 4)  # [c, NB, 16, K/4, 4]
        torch.mul(q, scale.view(c, nb, 16, 1, 1), out=out.view(c, nb, 16, k // 4, 4))
    elif method == "AMXINT4":
        g = group_size
        v = data.view(c, nb, k // 8, 1, 64)
        u = torch.cat([v & 0xF, v >> 4], dim=3)  # low nibble: 4-byte step 2j, high: 2j+1
        u = u.view(c, nb, k // 4, 16, 4).permute(0, 1, 3, 2, 4).unflatten(3, (k // g, g // 4))  # [c,NB,16,K/G,G/4,4]
        d = scale.permute(0, 1, 3, 2)[..., None, None]  # [c, NB, 16, K/G, 1, 1]
        m = -8.0 * d if zero is None else zero.permute(0, 1, 3, 2)[..., None, None]
        prod = torch.empty(c, n, k, dtype=torch.float32, device=data.device).view(u.shape)
        torch.mul(u, d, out=prod)  # fp32, then one rounding in the add (as the reference: g * d + m)
        torch.add(prod, m, out=out.view(u.shape))
    elif method == "BF16":
        w = data.view(torch.bfloat16).view(c, nb, k // 2, 16, 2).permute(0, 1, 3, 2, 4)  # [c, NB, 16, K/2, 2]
        out.view(c, nb, 16, k // 2, 2).copy_(w)
    elif method == "FP8":
        g = group_size
        # line q, byte 16L + 8p + 2 i2 + kp = (row 4L + i2, k 4q + 2p + kp) of the block (quant.pack_pairs)
        w = data.view(torch.float8_e4m3fn).view(c, nb, k // 4, 4, 2, 4, 2).permute(0, 1, 3, 5, 2, 4, 6)
        f = out if dtype == torch.float32 else torch.empty(c, n, k, dtype=torch.float32, device=data.device)
        f.view(c, nb, 4, 4, k // 4, 2, 2).copy_(w)  # exact: every e4m3 value is a fp32 value
        f.view(c, nb, 16, k // g, g).mul_(scale.view(c, nb, 1, k // g, 1))  # fp32, one rounding, as the reference
        if f is not out:
            out.copy_(f)
    else:
        raise ValueError(f"unknown packed method {method!r}")
    return out


def _copy_blocked_rows(dst: torch.Tensor, blocks: torch.Tensor) -> None:
    """dst [c, R, H] <- rows 0..R-1 of blocks [c, NB, 16, Hp] (row r = block r // 16, row r % 16)."""
    c, r, h = dst.shape
    full, rem = divmod(r, 16)
    if full:
        dst[:, : full * 16].view(c, full, 16, h).copy_(blocks[:, :full, :, :h])
    if rem:
        dst[:, full * 16:].copy_(blocks[:, full, :rem, :h])


def dequantize_experts(
    parts: dict[str, torch.Tensor],  # packed_parts() rows of c experts, on the compute device
    fmt: PackedFormat,
    gate_up: torch.Tensor,  # out [c, 2I, H]
    down: torch.Tensor,  # out [c, H, I]
) -> None:
    """Dequantizes c packed experts into dense gate_up / down (gate rows first, padding dropped),
    a bounded number of experts at a time."""
    c = gate_up.shape[0]
    i, h, ip, hp = fmt.inter, fmt.hidden, fmt.inter_pad, fmt.hidden_pad
    step = max(1, DEQUANT_CHUNK_ELEMS // (2 * ip * hp))
    for e0 in range(0, c, step):
        e1 = min(c, e0 + step)
        rows = {name: t[e0:e1] for name, t in parts.items()}
        w13 = dequantize_packed(rows["w13.data"], rows.get("w13.scale"), rows.get("w13.zero"), fmt.method, 2 * ip,
                                hp, fmt.group_size, gate_up.dtype)  # [c', 2Ip, Hp], gate/up blocks interleaved
        v = w13.view(e1 - e0, ip // 16, 2, 16, hp)
        _copy_blocked_rows(gate_up[e0:e1, :i], v[:, :, 0])
        _copy_blocked_rows(gate_up[e0:e1, i:], v[:, :, 1])
        del w13, v
        w2 = dequantize_packed(rows["w2.data"], rows.get("w2.scale"), rows.get("w2.zero"), fmt.method, hp, ip,
                               fmt.group_size, down.dtype)  # [c', Hp, Ip]
        down[e0:e1].copy_(w2[:, :h, :i])


def dequantize_layer(p: PackedLayer, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """Every expert of a packed layer on `device`: gate_up [E, 2I, H], down [E, H, I] in `dtype`."""
    dev = torch.device(device)
    parts = {k: v.to(dev) for k, v in packed_parts(p).items()}
    gate_up = torch.empty(p.num_experts, 2 * p.inter, p.hidden, dtype=dtype, device=dev)
    down = torch.empty(p.num_experts, p.hidden, p.inter, dtype=dtype, device=dev)
    dequantize_experts(parts, PackedFormat.of(p), gate_up, down)
    return gate_up, down
