"""GGUF block formats (--kt-method LLAMAFILE): reference dequantizers, simple quantizers, and the
per-token activation quantization the native GGUF kernels mirror.

Legend: R rows, K values per row (a multiple of the type's block size), B blocks per row.
Weights stay as the GGUF file stores them: a row of K values is K / block_size blocks of
`type_size` bytes (layouts below, all little-endian, fp16 scales):
  Q4_0   32 values, 18 B: d, qs[16]; value j = low nibble of qs[j], j+16 the high one; w = d (q - 8)
  Q8_0   32 values, 34 B: d, qs int8[32]; w = d q
  Q4_K  256 values, 144 B: d, dmin, scales[12] (8 six-bit scales sc and mins m), qs[128]: 64-value
         chunk c holds qs[32c + l] low nibble = value 64c + l, high nibble = value 64c + 32 + l;
         w = d sc_j q - dmin m_j for sub-block j = value // 32
  Q5_K  256 values, 176 B: as Q4_K plus qh[32]: bit j of qh[l] is bit 4 of value 32j + l
  Q6_K  256 values, 210 B: ql[128], qh[64], scales int8[16], d; value v: half h = v // 128,
         r = v % 128: low 4 bits from ql[64h + r % 64] >> 4 (r // 64), high 2 from qh[32h + r % 32] >>
         2 (r // 32); w = d sc_{v // 16} (q - 32)
  IQ4_XS 256 values, 136 B: d, scales_h u16, scales_l[4], qs[128]: sub-block j (32 values) scale
         ls = (scales_l[j // 2] >> 4 (j % 2) & 15) | ((scales_h >> 2j & 3) << 4); value l < 16 low
         nibble of qs[16j + l], l >= 16 high nibble of qs[16j + l - 16]; w = d (ls - 32) KV[q]
Activations (csrc/gguf_common.h): per token, per 256 values, q = round(x * 127 / amax) int8 and
d = amax / 127 ("Q8_K-style"; `quantize_act_q8k` is the bit-for-bit mirror). Everything here is
torch on CPU; the tests check the dequantizers against `gguf.quants.dequantize`.
"""

from __future__ import annotations

import torch

# GGML type id -> (name, values per block, bytes per block)
TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    23: ("IQ4_XS", 256, 136),
}
TYPE_IDS = {name: tid for tid, (name, _, _) in TYPES.items()}
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
ACT_BLOCK = 256  # activation quantization block (values)


def type_id(t: int | str) -> int:
    """A GGML type given by id or name -> its id; a clear error for a type the kernels lack."""
    tid = TYPE_IDS.get(t.upper()) if isinstance(t, str) else int(t)
    if tid not in TYPES:
        raise ValueError(f"GGUF type {t!r} has no CPU kernel; supported: {sorted(TYPE_IDS)}")
    return tid


def row_bytes(t: int | str, k: int) -> int:
    """Bytes of one row of k values."""
    name, bs, ts = TYPES[type_id(t)]
    if k % bs:
        raise ValueError(f"{name} rows need a multiple of {bs} values, got {k}")
    return k // bs * ts


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2, n] (low nibbles, then high nibbles), int32."""
    q = qs.int()
    return torch.stack([q & 15, q >> 4], dim=-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K scales [..., 12] uint8 -> (sc, m) [..., 8] int32 (6 bits each)."""
    s = s.int()
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _deq_blocks(tid: int, b: torch.Tensor) -> torch.Tensor:
    """[n, type_size] uint8 blocks -> [n, block_size] float32."""
    n = b.shape[0]
    if tid == 2:  # Q4_0
        q = _nibbles(b[:, 2:]).reshape(n, 32)
        return _f16(b[:, 0:2]).unsqueeze(-1) * (q - 8).float()
    if tid == 8:  # Q8_0
        return _f16(b[:, 0:2]).unsqueeze(-1) * b[:, 2:].contiguous().view(torch.int8).float()
    if tid in (12, 13):  # Q4_K, Q5_K
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, 48:] if tid == 13 else b[:, 16:]
        q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)  # sub-block j = 2c + nibble
        if tid == 13:
            hb = (b[:, 16:48].int().unsqueeze(1) >> torch.arange(8).view(1, 8, 1)) & 1
            q = q | (hb << 4)
        w = d.view(n, 1, 1) * sc.unsqueeze(-1).float() * q.float() - dmin.view(n, 1, 1) * mn.unsqueeze(-1).float()
        return w.reshape(n, 256)
    if tid == 14:  # Q6_K
        ql, qh = b[:, 0:128].int().view(n, 2, 1, 64), b[:, 128:192].int().view(n, 2, 1, 32)
        lo = ((ql >> torch.tensor([0, 4]).view(1, 1, 2, 1)) & 15).reshape(n, 2, 4, 32)
        hi = (qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)) & 3
        q = ((lo | (hi << 4)) - 32).reshape(n, 16, 16).float()
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        return (_f16(b[:, 208:210]).view(n, 1, 1) * sc.unsqueeze(-1) * q).reshape(n, 256)
    if tid == 23:  # IQ4_XS
        d = _f16(b[:, 0:2])
        sh = b[:, 2].int() | (b[:, 3].int() << 8)
        j = torch.arange(8)
        ls = ((b[:, 4 + j // 2].int() >> (4 * (j % 2))) & 15) | (((sh.unsqueeze(-1) >> (2 * j)) & 3) << 4)
        q = _nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)
        kv = torch.tensor(IQ4_KVALUES, dtype=torch.float32)[q.long()]
        return (d.view(n, 1, 1) * (ls - 32).float().unsqueeze(-1) * kv).reshape(n, 256)
    raise ValueError(f"unsupported GGUF type {tid}")


def dequantize(data: torch.Tensor, t: int | str) -> torch.Tensor:
    """[..., row_bytes] uint8 rows -> [..., K] float32 (any leading dims)."""
    tid = type_id(t)
    _, bs, ts = TYPES[tid]
    data = torch.as_tensor(data)
    if data.dtype != torch.uint8 or data.shape[-1] % ts:
        raise ValueError(f"{TYPES[tid][0]} rows must be uint8 with a multiple of {ts} bytes, got "
                         f"{data.dtype} {tuple(data.shape)}")
    lead = data.shape[:-1]
    nb = data.shape[-1] // ts
    return _deq_blocks(tid, data.reshape(-1, ts)).reshape(*lead, nb * bs)


def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n] float -> [n, 2] uint8."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _quant_sub(x: torch.Tensor, nlev: int, asym: bool):
    """Sub-blocks x [n, S, L] -> per-sub-block (scale, min>=0) fitting levels 0..nlev (asym) or signed."""
    if asym:
        mn = (-x.amin(-1)).clamp_min(0)  # w = scale q - mn
        scale = (x.amax(-1) + mn) / nlev
        return scale, mn
    return x.abs().amax(-1) / nlev, None


def quantize(w: torch.Tensor, t: int | str) -> torch.Tensor:
    """[..., K] float -> [..., row_bytes] uint8: plain round-to-nearest quantizers (no importance
    search, unlike llama.cpp's), good enough for tests and small models."""
    tid = type_id(t)
    name, bs, ts = TYPES[tid]
    w = torch.as_tensor(w).float()
    lead, k = w.shape[:-1], w.shape[-1]
    if k % bs:
        raise ValueError(f"{name} rows need a multiple of {bs} values, got {k}")
    x = w.reshape(-1, bs)
    n = x.shape[0]
    if tid in (2, 8):
        import numpy as np
        from gguf import GGMLQuantizationType, quants

        out = quants.quantize(x.numpy().astype(np.float32), GGMLQuantizationType(tid))
        return torch.from_numpy(np.ascontiguousarray(out)).reshape(*lead, k // bs * ts)
    out = torch.zeros(n, ts, dtype=torch.uint8)
    if tid in (12, 13):
        nlev = 15 if tid == 12 else 31
        xs = x.view(n, 8, 32)
        scale, mn = _quant_sub(xs, nlev, asym=True)
        d = (scale.amax(-1) / 63).to(torch.float16).float()
        dmin = (mn.amax(-1) / 63).to(torch.float16).float()
        sc = torch.where(d[:, None] > 0, (scale / d[:, None].clamp_min(1e-30)).round(), 0).clamp(0, 63).int()
        mi = torch.where(dmin[:, None] > 0, (mn / dmin[:, None].clamp_min(1e-30)).round(), 0).clamp(0, 63).int()
        eff, off = d[:, None] * sc, dmin[:, None] * mi
        q = torch.where(eff[..., None] > 0, ((xs + off[..., None]) / eff[..., None].clamp_min(1e-30)).round(), 0)
        q = q.clamp(0, nlev).int()  # [n, 8, 32]
        out[:, 0:2], out[:, 2:4] = _to_f16_bytes(d), _to_f16_bytes(dmin)
        s = torch.zeros(n, 12, dtype=torch.int32)
        s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        s[:, 4:8] = (mi[:, :4] & 63) | ((mi[:, 4:] >> 4) << 6)
        s[:, 8:12] = (sc[:, 4:] & 15) | ((mi[:, 4:] & 15) << 4)
        out[:, 4:16] = s.to(torch.uint8)
        q4 = (q & 15).view(n, 4, 2, 32)
        qs = (q4[:, :, 0] | (q4[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)
        if tid == 13:
            hb = ((q >> 4) & 1) << torch.arange(8).view(1, 8, 1)
            out[:, 16:48] = hb.sum(1).to(torch.uint8)
            out[:, 48:] = qs
        else:
            out[:, 16:] = qs
    elif tid == 14:  # Q6_K
        xs = x.view(n, 16, 16)
        scale, _ = _quant_sub(xs, 31, asym=False)
        d = (scale.amax(-1) / 127).to(torch.float16).float()
        sc = torch.where(d[:, None] > 0, (scale / d[:, None].clamp_min(1e-30)).round(), 0).clamp(-128, 127).int()
        eff = d[:, None] * sc
        q = torch.where(eff[..., None] > 0, (xs / eff[..., None].clamp_min(1e-30)).round(), 0).clamp(-32, 31).int() + 32
        q = q.reshape(n, 2, 4, 32)  # half, quarter, 32
        lo, hi = q & 15, q >> 4
        out[:, 0:128] = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(n, 128).to(torch.uint8)
        out[:, 128:192] = (hi << torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)).sum(2).reshape(n, 64).to(torch.uint8)
        out[:, 192:208] = sc.to(torch.int8).view(torch.uint8)
        out[:, 208:210] = _to_f16_bytes(d)
    else:  # IQ4_XS: the scale maps the sub-block's amax onto the table's end, nearest table value
        xs = x.view(n, 8, 32)
        scale = xs.abs().amax(-1) / 127
        d = (scale.amax(-1) / 31).to(torch.float16).float()
        ls = torch.where(d[:, None] > 0, (scale / d[:, None].clamp_min(1e-30)).round(), 0).clamp(-32, 31).int()
        eff = d[:, None] * ls
        kv = torch.tensor(IQ4_KVALUES, dtype=torch.float32)
        target = torch.where(eff[..., None] != 0, xs / torch.where(eff == 0, 1, eff)[..., None], 0)
        q = (target.unsqueeze(-1) - kv).abs().argmin(-1).int()  # [n, 8, 32]
        u = ls + 32
        out[:, 0:2] = _to_f16_bytes(d)
        sh = ((u >> 4) << (2 * torch.arange(8))).sum(-1)
        out[:, 2], out[:, 3] = (sh & 255).to(torch.uint8), (sh >> 8).to(torch.uint8)
        low = u & 15
        out[:, 4:8] = (low[:, 0::2] | (low[:, 1::2] << 4)).to(torch.uint8)
        qq = q.view(n, 8, 2, 16)
        out[:, 8:] = (qq[:, :, 0] | (qq[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)
    return out.reshape(*lead, k // bs * ts)


def random_blocks(t: int | str, rows: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random valid rows [rows, row_bytes]: random bytes with finite, modest fp16 scales."""
    tid = type_id(t)
    nbytes = row_bytes(tid, k)
    _, _, ts = TYPES[tid]
    b = torch.randint(0, 256, (rows * nbytes // ts, ts), dtype=torch.uint8, generator=generator)
    nb = b.shape[0]
    scale_at = {2: [0], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208], 23: [0]}[tid]
    for off in scale_at:
        s = torch.rand(nb, generator=generator) * 0.02 + 1e-3
        b[:, off:off + 2] = _to_f16_bytes(s)
    return b.reshape(rows, nbytes)


def quantize_act_q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] float -> (q int8 [R, Kp], d f32 [R, Kp/256]), Kp = K rounded up to 256 (zero padded):
    per 256 values q = round(x * (127 / amax)) in fp32 (ties to even), d = amax / 127 (0 for an
    all-zero block). The kernels compute the same values."""
    x = x.float()
    r, k = x.shape
    kp = -(-k // ACT_BLOCK) * ACT_BLOCK
    xp = torch.zeros(r, kp, dtype=torch.float32)
    xp[:, :k] = x
    xb = xp.view(r, kp // ACT_BLOCK, ACT_BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, 1), 0)
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.view(r, kp), amax / 127


def act_round_q8k(x: torch.Tensor) -> torch.Tensor:
    """[R, K] -> the values the kernels multiply (float64), for reference.moe_reference."""
    q, d = quantize_act_q8k(x)
    r, k = x.shape
    v = q.double().view(r, -1, ACT_BLOCK) * d.double().unsqueeze(-1)
    return v.view(r, -1)[:, :k]
