"""GGUF experts split between GPU and CPU (--kt-method LLAMAFILE with --kt-num-gpu-experts /
--kt-gpu-experts-ratio): the GPU-resident ones dequantized from their GGUF blocks at load, the CPU
ones kept as the file's blocks, and each layer's real bytes for the startup memory plan.

Legend: E experts of the layer, Eg / Ec GPU / CPU experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import torch

from hybridmoe.cpu import gguf_quant
from hybridmoe.cpu.gguf_engine import GGUFExperts
from hybridmoe.cpu.quant import page_aligned_empty
from hybridmoe.gguf.experts import expert_name
from hybridmoe.gguf.reader import GGUFModel
from hybridmoe.moe.experts import ExpertWeights


def _rows(m: torch.Tensor, ids: torch.Tensor, page_align: bool) -> torch.Tensor:
    """m[ids] (experts' rows): a view of the file when ids are one contiguous run, else a copy (in
    pages of its own with page_align: page-locked in place for the layerwise GPU prefill)."""
    n = len(ids)
    if n and int(ids[-1]) - int(ids[0]) == n - 1:
        return m[int(ids[0]): int(ids[0]) + n]
    if not page_align:
        return m[ids].contiguous()
    out = page_aligned_empty((n, *m.shape[1:]), m.dtype)
    torch.index_select(m, 0, ids, out=out)
    return out


def select_experts(x: GGUFExperts, ids: torch.Tensor, page_align: bool = False) -> GGUFExperts:
    """The experts `ids` of a layer ([Ec] int, in order), their blocks as they are."""
    return GGUFExperts(*(_rows(m, ids, page_align) for m in (x.gate, x.up, x.down)), x.types, x.hidden, x.inter,
                       x.activation)


def gpu_expert_weights(x: GGUFExperts, mask: torch.Tensor, dtype: torch.dtype) -> ExpertWeights:
    """ExpertWeights [E, ...] in `dtype` whose GPU-resident rows (mask True) hold the dequantized GGUF
    experts. The other rows are never written: torch.empty leaves their pages untouched, so only the
    Eg experts take host memory while the hybrid layer copies them to the GPU."""
    e = x.num_experts
    gate_up = torch.empty(e, 2 * x.inter, x.hidden, dtype=dtype)  # [E, 2I, H]
    down = torch.empty(e, x.hidden, x.inter, dtype=dtype)  # [E, H, I]
    for i in mask.nonzero().flatten().tolist():  # one expert at a time: the fp32 temporaries stay small
        gate_up[i, : x.inter] = gguf_quant.dequantize(x.gate[i], x.types[0])
        gate_up[i, x.inter:] = gguf_quant.dequantize(x.up[i], x.types[1])
        down[i] = gguf_quant.dequantize(x.down[i], x.types[2])
    return ExpertWeights(gate_up=gate_up, down=down, activation=x.activation)


def expert_bytes_by_layer(model: GGUFModel, layers) -> dict[int, int]:
    """Bytes of one routed expert of each MoE layer in the file's blocks (its three projections)."""
    out = {}
    for layer in layers:
        total = 0
        for proj in ("gate", "up", "down"):
            t = model.tensor(expert_name(layer, proj))
            total += t.shape[1] * gguf_quant.row_bytes(t.type, t.shape[2]) if t.type in gguf_quant.TYPES \
                else int(t.data.nbytes) // t.shape[0]
        out[layer] = total
    return out
