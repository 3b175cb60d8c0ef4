"""The absorbed MLA decode in pure torch: the CPU path of the model (layers/attention/mla.py) and the
reference of the Triton kernel (layers/attention/mla_triton.py, which re-exports it). No triton import:
triton is not installed everywhere the model runs.

Legend: B sequences (one new token each), H query heads, Lkv latent width, R rope width, N pages,
S page size, P pages per sequence in the block table. The contract (cache layout, arguments) is
mla_triton.py's.
"""

from __future__ import annotations

import torch


def check_decode_inputs(q_lat, q_rope, kv_cache, block_table, seq_lens) -> tuple[int, int, int, int]:
    """Asserts the decode contract's shapes; returns (B, H, Lkv, R)."""
    assert q_lat.dim() == 3 and q_rope.dim() == 3 and kv_cache.dim() == 3, "q_lat [B,H,Lkv], q_rope [B,H,R], kv [N,S,Lkv+R]"
    bsz, heads, lkv = q_lat.shape
    rope = q_rope.shape[2]
    assert q_rope.shape[:2] == (bsz, heads), f"q_rope {tuple(q_rope.shape)} vs q_lat {tuple(q_lat.shape)}"
    assert kv_cache.shape[2] == lkv + rope, f"kv_cache rows {kv_cache.shape[2]} != Lkv {lkv} + R {rope}"
    assert block_table.dim() == 2 and block_table.shape[0] == bsz and seq_lens.shape == (bsz,)
    return bsz, heads, lkv, rope


def mla_decode_ref(
    q_lat: torch.Tensor,  # [B, H, Lkv]
    q_rope: torch.Tensor,  # [B, H, R]
    kv_cache: torch.Tensor,  # [N, S, Lkv + R]
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1 (a sequence of length 0 gets zeros)
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, Lkv]
    **_: object,  # mla_decode's tuning keywords, ignored
) -> torch.Tensor:  # [B, H, Lkv], dtype of q_lat
    """Pure-torch absorbed MLA decode: a batched masked gather of the whole block table, fp32 math.

    Only device tensors are read (no .item(), no host lengths), so it is graph-capturable too; it
    is the CPU path of the model and the kernel's reference. Memory: the gathered rows
    [B, P * S, Lkv + R] in fp32 and the scores [B, H, P * S].
    """
    bsz, heads, lkv, rope = check_decode_inputs(q_lat, q_rope, kv_cache, block_table, seq_lens)
    rows = kv_cache[block_table.long()].flatten(1, 2).float()  # [B, P*S, Lkv+R]
    pos = torch.arange(rows.shape[1], device=q_lat.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, P*S]
    # rows past a sequence's end hold another request's leftovers (freed pages are not cleared): zeroed,
    # since a probability of 0 times a NaN or inf left there is NaN
    rows = rows.masked_fill(~valid[..., None], 0.0)
    c_kv = rows[..., :lkv]
    scores = torch.einsum("bhl,btl->bht", q_lat.float(), c_kv)
    scores = scores + torch.einsum("bhr,btr->bht", q_rope.float(), rows[..., lkv:])
    probs = torch.softmax((scores * scale).masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    o = torch.einsum("bht,btl->bhl", probs, c_kv)
    o = torch.where((seq_lens > 0)[:, None, None], o, 0.0)  # softmax of no token is NaN
    if out is None:
        return o.to(q_lat.dtype)
    out.copy_(o)
    return out


__all__ = ["check_decode_inputs", "mla_decode_ref"]
