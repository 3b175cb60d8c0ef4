"""Block-scaled fp8 weights (DeepSeek-V3 style): `W.weight` float8_e4m3fn [N, K] with
`W.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)], where `quantization_config.weight_block_size`
= [bn, bk]; the real weight is w = fp8 * scale_inv of its block. Dequantized on the CPU, no GPU.

Legend: N output rows, K input columns, bn x bk the block, Nb = ceil(N/bn), Kb = ceil(K/bk).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MAX = 448.0


def scale_name(weight_name: str) -> str:
    """`...down_proj.weight` -> `...down_proj.weight_scale_inv`."""
    return weight_name[: -len("weight")] + "weight_scale_inv" if weight_name.endswith("weight") \
        else weight_name + "_scale_inv"


def block_size_of(config) -> tuple[int, int]:
    """[bn, bk] from the config's quantization_config; ValueError if the checkpoint is not block-scaled fp8."""
    q = getattr(config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    block = (q or {}).get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError("--input-type fp8 needs quantization_config.weight_block_size in config.json "
                         f"(block-scaled fp8, as DeepSeek-V3 publishes); got quantization_config={q}")
    return int(block[0]), int(block[1])


def block_dequant(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 [N, K] * per-block scale [Nb, Kb] -> float32 [N, K] (into `out` if given)."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(f"scale has shape {tuple(scale_inv.shape)}, expected {(nb, kb)} for a [{n}, {k}] weight "
                         f"in {bn}x{bk} blocks")
    s = scale_inv.float()
    if n % bn == 0 and k % bk == 0:  # no expanded scale tensor: broadcast over the block dims
        res = (w.float().view(nb, bn, kb, bk) * s.view(nb, 1, kb, 1)).view(n, k)
    else:
        res = w.float() * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    if out is None:
        return res
    return out.copy_(res)


def block_quant(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], scale_inv float32 [Nb, Kb]): amax of each block -> 448.
    The inverse of block_dequant (up to fp8 rounding); used to make fp8 checkpoints for tests."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    amax = wp.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (wp.view(nb, bn, kb, bk) / scale.view(nb, 1, kb, 1)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.view(nb * bn, kb * bk)[:n, :k].to(torch.float8_e4m3fn).contiguous(), scale
