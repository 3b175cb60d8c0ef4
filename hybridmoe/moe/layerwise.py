"""Layerwise GPU prefill (`--kt-gpu-prefill-token-threshold`) and dynamic expert update
(`--kt-enable-dynamic-expert-update`) for hybrid MoE layers.

Legend: T tokens, H hidden, I expert intermediate, E experts of a layer, Ec experts streamed (the
layer's CPU-resident ones), Eg GPU-resident ones, "p" padded sizes of the packed layout, C swap
candidates per layer (min(Eg, Ec)).

A forward with T >= threshold computes every routed expert on the GPU side. Per MoE layer:
  1. copy stream: the layer's CPU-resident experts' packed bytes (the CPU engine's PackedLayer:
     int8/int4/bf16/fp8 blocks + scales, or --kt-method LLAMAFILE's GGUF rows, gguf/stream.py;
     page-locked in place by `cuda_driver.page_lock`) -> staging slot
     (moe index % 2) on the GPU; layer L+1's copy is issued when layer L starts (the first MoE
     layer's when the forward starts), after the event saying layer L-1 finished reading that slot;
  2. compute stream: wait for the copy, dequantize into one layer-sized buffer gate_up [Ec, 2I, H],
     down [Ec, H, I] in the model dtype (`cpu.dequant.dequantize_experts`, device-agnostic torch; GGUF
     blocks: `gguf.stream.dequantize_gguf_experts`, a Triton kernel), record that the slot is free;
  3. the GPU backend computes the resident experts (gpu_local ids) and the streamed ones
     (stream_local ids) in two calls, summed (HybridExperts._forward_layerwise);
  4. with dynamic update: per-expert token counts of this batch (bincount on the device) decide
     which streamed experts replace the least-used resident ones (`swap_hot_experts`); their
     weights are copied from the buffer into the resident weight tensors, and the index tensors
     are updated in place, with no host sync (captured CUDA graphs keep reading the same tensors).
     After the forward one sync reads the swaps back to update the host masks and copy plans.
On `--device cpu` the same code runs: the copies are plain CPU copies and there are no streams.

GPU memory: the buffer (Ec_max experts in the model dtype), two staging slots, each as large as
the largest layer's streamed bytes (GGUF layers may each have their own types: a slot is one byte
buffer, viewed per layer as that layer's tensors), and the dequantization temporaries (bounded by
cpu.dequant.DEQUANT_CHUNK_ELEMS; none for GGUF blocks).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hybridmoe.cpu.dequant import PackedFormat, dequantize_experts, packed_parts
from hybridmoe.moe.experts import ExpertWeights
from hybridmoe.weights.fp8 import FP8_DTYPES

if TYPE_CHECKING:
    from hybridmoe.moe.hybrid import HybridExperts
    from hybridmoe.moe.runtime import HybridRuntime

log = logging.getLogger(__name__)

SWAP_CHUNK = 8  # swap candidates moved per step (bounds the gathered temporaries)
STAGE_ALIGN = 256  # bytes: where each tensor of a staging slot starts


def stream_source(packed) -> tuple[object, dict[str, torch.Tensor]]:
    """(format, tensors streamed [E_cpu, ...]) of a CPU engine layer's weights: a PackedLayer, or
    GGUFExperts (--kt-method LLAMAFILE)."""
    from hybridmoe.cpu.gguf_engine import GGUFExperts

    if isinstance(packed, GGUFExperts):
        from hybridmoe.gguf.stream import GGUFFormat, gguf_parts

        return GGUFFormat.of(packed), gguf_parts(packed)
    return PackedFormat.of(packed), packed_parts(packed)


def dequantize_streamed(parts: dict[str, torch.Tensor], fmt, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Streamed experts (stream_source's tensors, on the compute device) -> dense gate_up / down."""
    if isinstance(fmt, PackedFormat):
        dequantize_experts(parts, fmt, gate_up, down)
    else:
        from hybridmoe.gguf.stream import dequantize_gguf_experts

        dequantize_gguf_experts(parts, fmt, gate_up, down)


def stage_layout(parts: dict[str, torch.Tensor], num: int) -> dict[str, tuple[int, int]]:
    """name -> (byte offset, bytes) of `num` experts of each tensor in a staging slot."""
    out, off = {}, 0
    for name, t in parts.items():
        nbytes = num * (t[0].nbytes if t.shape[0] else 0)
        out[name] = (off, nbytes)
        off += -(-nbytes // STAGE_ALIGN) * STAGE_ALIGN
    return out


def slot_bytes(parts: dict[str, torch.Tensor], num: int) -> int:
    """Bytes of a staging slot holding `num` experts of these tensors."""
    return sum(-(-n // STAGE_ALIGN) * STAGE_ALIGN for _, n in stage_layout(parts, num).values())


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
    """Staging slots, the layer buffer, the copy stream and its events, shared by a runtime's layers
    (`plan` is the HybridRuntime: its device, moe_layers and attached layers are read)."""

    def __init__(self, plan: HybridRuntime) -> None:
        self.plan = plan
        self.device = plan.device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []  # slot filled
        self.consumed = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else []  # slot read
        self.staging: list[torch.Tensor] = []  # per slot: uint8 bytes, viewed per layer (stage_views)
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
        ts = list(self.staging)
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
        if dtype in FP8_DTYPES:  # fp8 experts (FP8 method) are streamed as fp8, computed on in bf16
            dtype = torch.bfloat16
        with torch.inference_mode(False):  # ordinary tensors, usable inside and outside inference mode
            nbytes = max(slot_bytes(lay.packed_parts, lay.num_streamed) for lay in layers)
            self.staging = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
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
        stage, src = self.stage_views(slot, layer), layer.packed_parts
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
        dequantize_streamed(self.stage_views(slot, layer), layer.fmt, w.gate_up, w.down)
        if self.cuda:
            self.consumed[slot].record()
        return w

    def stage_views(self, slot: int, layer: HybridExperts) -> dict[str, torch.Tensor]:
        """The layer's tensors in staging slot `slot`: name -> [Ec, ...] in the layer's dtypes and shapes."""
        flat, ec, src = self.staging[slot], layer.num_streamed, layer.packed_parts
        return {name: flat[off:off + n].view(src[name].dtype).view(ec, *src[name].shape[1:])
                for name, (off, n) in stage_layout(src, ec).items()}

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
