"""The CPU kernels' byte layouts of packed weights, and their inverses (no quantization here).

Legend: E experts, N rows (output features), K columns (input features), G group size; every
layout tiles 16 rows (one AMX tile height) by a K step of 4 bytes (csrc/common.h).
"""

from __future__ import annotations

import torch


def pack_blocks(q: torch.Tensor, bytes_per_value: int) -> torch.Tensor:
    """[E, N, K] int8/bf16 -> [E, N/16, K/step, 16, step] (step = 4 bytes), as raw uint8 [E, bytes]."""
    e, n, k = q.shape
    step = 4 // bytes_per_value
    p = q.reshape(e, n // 16, 16, k // step, step).permute(0, 1, 3, 2, 4).contiguous()
    return p.view(torch.uint8).reshape(e, -1)


def unpack_blocks(p: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    e = p.shape[0]
    step = 4 // torch.empty(0, dtype=dtype).element_size()
    v = p.reshape(e, -1).view(dtype).reshape(e, n // 16, k // step, 16, step)
    return v.permute(0, 1, 3, 2, 4).reshape(e, n, k)


def pack_int4_blocks(u: torch.Tensor) -> torch.Tensor:
    """[E, N, K] nibbles in [0, 15] -> uint8 [E, N/16 * K/8 * 64]: low nibble = step 2j, high = 2j+1."""
    e, n, k = u.shape
    lay = u.reshape(e, n // 16, 16, k // 4, 4).permute(0, 1, 3, 2, 4).reshape(e, n // 16, k // 8, 2, 64)
    return (lay[:, :, :, 0] | (lay[:, :, :, 1] << 4)).contiguous().reshape(e, -1)


def unpack_int4_blocks(p: torch.Tensor, n: int, k: int) -> torch.Tensor:
    e = p.shape[0]
    v = p.reshape(e, n // 16, k // 8, 1, 64)
    lay = torch.cat([v & 0xF, v >> 4], dim=3).reshape(e, n // 16, k // 4, 16, 4)
    return lay.permute(0, 1, 3, 2, 4).reshape(e, n, k)


def pack_group_params(d: torch.Tensor) -> torch.Tensor:
    """[E, N, K/G] -> [E, N/16, K/G, 16] f32 (the 16 rows of a block side by side)."""
    e, n, ng = d.shape
    return d.reshape(e, n // 16, 16, ng).permute(0, 1, 3, 2).contiguous().float()


def unpack_group_params(p: torch.Tensor, n: int) -> torch.Tensor:
    e, nb, ng, _ = p.shape
    return p.permute(0, 1, 3, 2).reshape(e, n, ng)


def pack_pairs(u: torch.Tensor) -> torch.Tensor:
    """[E, N, K] 1-byte values (FP8) -> uint8 [E, N/16 * K/4 * 64]: per 16-row block, 64-byte lines of
    two bf16-layout steps (step = K pair x 16 rows, value v = 2 * row + k parity) lane-interleaved:
    line byte 16L + 8p + i = value 8L + i of step p (csrc/common.h), which the AVX-512 byte unpacks
    widen back to the two steps in order."""
    e, n, k = u.shape
    # (row = 4L + i2, k = 4q + 2p + kp) -> line q, byte 16L + 8p + 2 i2 + kp
    v = u.reshape(e, n // 16, 4, 4, k // 4, 2, 2).permute(0, 1, 4, 2, 5, 3, 6)
    return v.contiguous().reshape(e, -1)


def unpack_pairs(p: torch.Tensor, n: int, k: int) -> torch.Tensor:
    e = p.shape[0]
    return p.reshape(e, n // 16, k // 4, 4, 2, 4, 2).permute(0, 1, 3, 5, 2, 4, 6).reshape(e, n, k)
