"""Layerwise GPU prefill (`--kt-gpu-prefill-token-threshold`) and dynamic expert update
(`--kt-enable-dynamic-expert-update`) for hybrid MoE layers.

Legend: T tokens, H hidden, I expert intermediate, E experts of a layer, Ec experts streamed (the
layer's CPU-resident ones), Eg GPU-resident ones, "p" padded sizes of the packed layout, C swap
candidates per layer (min(Eg, Ec)).

A forward with T >= threshold computes every routed expert on the GPU side. Per MoE layer:
  1. copy stream: the layer's CPU-resident experts' packed bytes (the CPU engine's PackedLayer:
     int8/int4/bf16 blocks + scales, page-locked in place by `page_lock`) -> staging slot
     (moe index % 2) on the GPU; layer L+1's copy is issued when layer L starts (the first MoE
     layer's when the forward starts), after the event saying layer L-1 finished reading that slot;
  2. compute stream: wait for the copy, dequantize into one layer-sized buffer gate_up [Ec, 2I, H],
     down [Ec, H, I] in the model dtype (`dequantize_experts`, device-agnostic torch), record that
     the slot is free;
  3. the GPU backend computes the resident experts (gpu_local ids) and the streamed ones
     (stream_local ids) in two calls, summed (HybridExperts._forward_layerwise);
  4. with dynamic update: per-expert token counts of this batch (bincount on the device) decide
     which streamed experts replace the least-used resident ones (`swap_hot_experts`); their
     weights are copied from the buffer into the resident weight tensors, and the index tensors
     are updated in place, with no host sync (captured CUDA graphs keep reading the same tensors).
     After the forward one sync reads the swaps back to update the host masks and copy plans.
On `--device cpu` the same code runs: the copies are plain CPU copies and there are no streams.

GPU memory: the buffer (Ec_max experts in the model dtype), two staging slots of Ec_max packed
experts, and the dequantization temporaries (bounded by DEQUANT_CHUNK_ELEMS).
"""

from __future__ import annotations

import ctypes as C
import logging
import mmap
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridmoe.cpu.quant import PackedLayer
from hybridmoe.moe.experts import ExpertWeights

if TYPE_CHECKING:
    from hybridmoe.moe.hybrid import HybridExperts, HybridPlan

log = logging.getLogger(__name__)

DEQUANT_CHUNK_ELEMS = 1 << 25  # padded matrix elements dequantized at a time (bounds the temporaries)
SWAP_CHUNK = 8  # swap candidates moved per step (bounds the gathered temporaries)


# ---- packed layout -> dense weights, on any device ---------------------------------------------
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
    scale: torch.Tensor | None,  # int8: f32 [c, N]; int4: f32 [c, N/16, K/G, 16]
    zero: torch.Tensor | None,  # int4 asymmetric: f32 [c, N/16, K/G, 16]
    method: str,
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [c, n, k] (padded), dtype
    """Packed block layout -> dense rows, with the reference's fp32 arithmetic (quant.py) rounded
    once to `dtype`: int8 s[n] * q, int4 (d * u) + m (m = -8 d when symmetric), bf16 as is."""
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


# ---- page-locking the CPU experts in place -----------------------------------------------------
_warned = False
_locked: list[tuple[int, int]] = []  # page ranges registered by page_lock, sorted


def _cuda_driver():
    from hybridmoe.moe.cuda_bridge import libcuda

    return libcuda()


def is_page_locked(t: torch.Tensor) -> bool:
    """Whether the driver sees t's first and last bytes as page-locked host memory. (torch's
    Tensor.is_pinned looks at the start of the tensor's storage, which for a page-aligned view
    (cpu.quant.page_aligned) lies before the locked pages.)"""
    if t.nbytes == 0:
        return True
    lib, flags = _cuda_driver(), C.c_uint()
    return all(lib.cuMemHostGetFlags(C.byref(flags), C.c_void_p(p)) == 0
               for p in (t.data_ptr(), t.data_ptr() + t.nbytes - 1))


def _unregister(ranges: list[tuple[int, int]]) -> None:
    try:
        lib = _cuda_driver()
        for r in ranges:
            lib.cuMemHostUnregister(C.c_void_p(r[0]))
            _locked.remove(r)
    except Exception:  # interpreter or driver shutting down
        pass


def _gaps(lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) not registered yet."""
    out = []
    for a, b in _locked:
        if b <= lo or a >= hi:
            continue
        if a > lo:
            out.append((lo, a))
        lo = max(lo, b)
    if lo < hi:
        out.append((lo, hi))
    return out


def page_lock(owner: object, tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Page-locks the memory of CPU tensors in place (cuMemHostRegister: the driver-API twin of
    cudaHostRegister, which leaves the runtime's last-error state alone), never copying them, so
    H2D copies from them are DMA at full speed. The tensors must own their pages (CPUExperts'
    page_align: a page shared with other memory would be only partly locked, and DMA from such a
    range fails with "invalid argument"). Whole pages are registered, each once per process
    (tensors of several layers may share a page); unregistered when `owner` is collected (before
    the tensors are freed, as long as `owner` holds them). False (with one warning per process)
    where it fails: the copies then read pageable memory, correct but several times slower."""
    global _warned
    page = mmap.PAGESIZE
    spans = sorted((t.data_ptr() // page * page, -(-(t.data_ptr() + t.nbytes) // page) * page)
                   for t in tensors if t.nbytes)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    todo = [g for lo, hi in merged for g in _gaps(lo, hi)]
    if not todo:
        return True
    torch.zeros(1, device=device)  # the primary context is current on this thread
    mine: list[tuple[int, int]] = []
    rc = 0
    try:
        lib = _cuda_driver()
        for lo, hi in todo:
            rc = lib.cuMemHostRegister_v2(C.c_void_p(lo), hi - lo, 0)
            if rc == 712:  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: page-locked by someone else
                rc = 0
            elif rc == 0:
                mine.append((lo, hi))
            else:
                break
    except OSError as e:
        rc = -1
        log.debug("libcuda: %s", e)
    if mine:
        _locked.extend(mine)
        _locked.sort()
        weakref.finalize(owner, _unregister, mine).atexit = False
    if rc != 0 and not _warned:
        _warned = True
        log.warning("layerwise prefill: cannot page-lock the CPU expert weights (CUDA error %d); copying them "
                    "from pageable memory (slower)", rc)
    return rc == 0


# ---- the per-forward machinery -------------------------------------------------------------------
def stream_runs(mask: torch.Tensor, full_layer: bool) -> list[tuple[int, int, int]]:
    """Copy plan of a layer's streamed experts: (row in the CPU layer, slot in the buffer, count)
    runs. The buffer holds the CPU-resident experts in expert order; the CPU layer row of expert e
    is e when it holds every expert (dynamic update), else e's rank among the CPU-resident ones."""
    ids = (~mask).nonzero().flatten().tolist()
    rows = ids if full_layer else list(range(len(ids)))
    runs: list[list[int]] = []
    for slot, row in enumerate(rows):  # host bookkeeping, at startup and after swaps
        if runs and runs[-1][0] + runs[-1][2] == row:
            runs[-1][2] += 1
        else:
            runs.append([row, slot, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


class LayerwisePrefill:
    """Staging slots, the layer buffer, the copy stream and its events, shared by a plan's layers."""

    def __init__(self, plan: HybridPlan) -> None:
        self.plan = plan
        self.device = plan.device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []  # slot filled
        self.consumed = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []  # slot read
        self.staging: list[dict[str, torch.Tensor]] = []  # per slot: name -> [Ec_max, ...]
        self.buffer: ExpertWeights | None = None  # gate_up [Ec_max, 2I, H], down [Ec_max, H, I]
        self._issued: dict[int, int] = {}  # moe index -> staging slot, this forward
        self._swaps: list[tuple[HybridExperts, torch.Tensor]] = []  # (layer, [5, C] record), this forward
        self.num_forwards = 0
        self.last_swaps: dict[int, list[tuple[int, int, int, int]]] = {}  # layer -> (in, out, count in, count out)
        self.total_swaps = 0

    def _streamed_layers(self) -> list[HybridExperts]:
        return [lay for lay in self.plan.layers.values() if lay.cpu is not None]

    def nbytes(self) -> int:
        """GPU bytes held (buffer + staging)."""
        ts = [t for s in self.staging for t in s.values()]
        if self.buffer is not None:
            ts += [self.buffer.gate_up, self.buffer.down]
        return sum(t.nbytes for t in ts)

    def _allocate(self) -> None:
        layers = self._streamed_layers()
        if not layers or self.buffer is not None:
            return
        ec = max(lay.num_streamed for lay in layers)
        first = layers[0]
        fmt, dtype, dev = first.fmt, first.dtype, self.device
        with torch.inference_mode(False):  # ordinary tensors, usable inside and outside inference mode
            self.staging = [{k: torch.empty(ec, *t.shape[1:], dtype=t.dtype, device=dev)
                             for k, t in first.packed_parts.items()} for _ in range(2)]
            self.buffer = ExpertWeights(torch.empty(ec, 2 * fmt.inter, fmt.hidden, dtype=dtype, device=dev),
                                        torch.empty(ec, fmt.hidden, fmt.inter, dtype=dtype, device=dev),
                                        first.activation)
        log.info("layerwise prefill buffers: %.2f GiB on %s (%d streamed experts per layer at most)",
                 self.nbytes() / (1 << 30), dev, ec)

    def begin(self) -> None:
        """A layerwise forward starts: the first MoE layer's copy is issued now."""
        self._allocate()
        self._issued.clear()
        self._swaps.clear()
        self.num_forwards += 1
        self.prefetch(0)

    def prefetch(self, idx: int) -> None:
        """Issues the copy of MoE layer number `idx` (in plan.moe_layers order) into staging slot idx % 2
        unless done in this forward."""
        moe = self.plan.moe_layers
        if idx >= len(moe) or idx in self._issued:
            return
        slot = self._issued[idx] = idx % 2
        layer = self.plan.layers.get(moe[idx])
        if layer is None or layer.cpu is None:
            return
        stage, src = self.staging[slot], layer.packed_parts
        if self.cuda:
            self.copy_stream.wait_event(self.consumed[slot])  # layer idx-2 has dequantized from this slot
            with torch.cuda.stream(self.copy_stream):
                self._copy(layer.runs, stage, src, non_blocking=True)
                self.copied[slot].record(self.copy_stream)
        else:
            self._copy(layer.runs, stage, src, non_blocking=False)

    @staticmethod
    def _copy(runs: list[tuple[int, int, int]], stage: dict[str, torch.Tensor], src: dict[str, torch.Tensor],
              non_blocking: bool) -> None:
        for row, slot, n in runs:
            for name, t in src.items():
                stage[name][slot:slot + n].copy_(t[row:row + n], non_blocking=non_blocking)

    def acquire(self, layer: HybridExperts) -> ExpertWeights:
        """The layer's streamed experts, dense in the buffer (views [Ec, 2I, H] / [Ec, H, I]); stream-ordered
        after their copy. Valid until the next layer's acquire."""
        idx = layer.moe_index
        self.prefetch(idx)
        slot = self._issued[idx]
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[slot])
        ec = layer.num_streamed
        assert self.buffer is not None
        w = ExpertWeights(self.buffer.gate_up[:ec], self.buffer.down[:ec], self.buffer.activation)
        dequantize_experts({k: v[:ec] for k, v in self.staging[slot].items()}, layer.fmt, w.gate_up, w.down)
        if self.cuda:
            self.consumed[slot].record()
        return w

    def note_swaps(self, layer: HybridExperts, record: torch.Tensor) -> None:
        self._swaps.append((layer, record))

    def end(self) -> None:
        """The forward is over: read the swaps back (one sync) and update the host side."""
        self._issued.clear()
        swaps, self._swaps = self._swaps, []
        if not swaps:
            return
        rows = torch.cat([r for _, r in swaps], dim=1).tolist()  # [5, sum C]: do, in, out, count in, count out
        self.last_swaps = {}
        pos = 0
        for layer, rec in swaps:
            c = rec.shape[1]
            moved = [(rows[1][j], rows[2][j], rows[3][j], rows[4][j]) for j in range(pos, pos + c) if rows[0][j]]
            pos += c
            if moved:
                self.last_swaps[layer.layer_idx] = moved
                layer.apply_host_swaps(moved)
        n = sum(len(v) for v in self.last_swaps.values())
        self.total_swaps += n
        log.info("dynamic expert update: %d experts swapped between the GPU and the CPU in %d of %d MoE layers",
                 n, len(self.last_swaps), len(swaps))


def swap_hot_experts(
    counts: torch.Tensor,  # [E] int64: tokens of the batch routed to each expert
    mask: torch.Tensor,  # [E] bool device: True = GPU-resident (updated in place)
    gpu_local: torch.Tensor,  # [E] int32: slot in the GPU weights, -1 (updated in place)
    cpu_local: torch.Tensor,  # [E] int32: row in the full CPU layer, -1 (updated in place)
    stream_local: torch.Tensor,  # [E] int32: slot in the layerwise buffer, -1 (updated in place)
    gpu_w: ExpertWeights,  # the resident experts' weights [Eg, ...] (updated in place)
    streamed: ExpertWeights,  # this layer's streamed experts, dense [Ec, ...]
    cap: int,  # C = min(Eg, Ec)
) -> torch.Tensor:  # [5, C] int64: do, expert in, expert out, count in, count out
    """The C most-used streamed experts are paired with the C least-used resident ones (in that
    order); a pair swaps when the streamed one got strictly more tokens (a prefix of the pairs).
    Device ops only: a pair that does not swap copies a resident expert onto itself."""
    e = counts.shape[0]
    order_in = torch.where(mask, -1, counts).sort(descending=True, stable=True).indices[:cap]
    order_out = torch.where(mask, counts, torch.iinfo(torch.int64).max).sort(stable=True).indices[:cap]
    c_in, c_out = counts[order_in], counts[order_out]
    do = c_in > c_out  # [C]
    dst = gpu_local[order_out].long()  # resident slots given up
    src = stream_local[order_in].long()  # buffer slots of the incoming experts
    for s in range(0, cap, SWAP_CHUNK):  # ceil(C / SWAP_CHUNK) steps, not one per expert
        d, sr, m = dst[s:s + SWAP_CHUNK], src[s:s + SWAP_CHUNK], do[s:s + SWAP_CHUNK, None, None]
        for resident, incoming in ((gpu_w.gate_up, streamed.gate_up), (gpu_w.down, streamed.down)):
            resident.index_copy_(0, d, torch.where(m, incoming[sr], resident[d]))
    slots = gpu_local[order_out]
    gpu_local.scatter_(0, order_in, torch.where(do, slots, -1).to(gpu_local.dtype))
    gpu_local.scatter_(0, order_out, torch.where(do, -1, slots).to(gpu_local.dtype))
    mask.scatter_(0, order_in, do)  # the non-swapping ones keep their side
    mask.scatter_(0, order_out, ~do)
    arange = torch.arange(e, dtype=cpu_local.dtype, device=counts.device)
    cpu_local.copy_(torch.where(mask, -1, arange))
    stream_local.copy_(torch.where(mask, -1, (~mask).cumsum(0) - 1).to(stream_local.dtype))
    return torch.stack([do.long(), order_in, order_out, c_in, c_out])
