"""A GGUF file holding only a model's routed experts, random valid blocks of one GGUF type, for
benchmarks that serve `--kt-method LLAMAFILE --kt-weight-path FILE` beside a `--load-format dummy`
model of the same shape (bench_hybrid_decode.py --gguf TYPE). Only speed is measured, so the values
do not matter; the layout is llama.cpp's (`blk.{L}.ffn_{gate,up,down}_exps.weight`, gate/up
[E, I, H] and down [E, H, I] in torch order, rows of GGUF blocks). One tensor is in memory at a time
(a 48-layer Qwen3-30B-A3B file of Q4_K experts is ~16 GB).

Legend: L layers, E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridmoe.cpu import gguf_quant as gq  # noqa: E402


def expert_tensors(moe_layers: list[int], e: int, h: int, i: int) -> list[tuple[str, int, int]]:
    """(name, rows per expert N, row length K) of every expert tensor, in file order."""
    out = []
    for layer in moe_layers:
        for proj, n, k in (("gate", i, h), ("up", i, h), ("down", h, i)):
            out.append((f"blk.{layer}.ffn_{proj}_exps.weight", n, k))
    return out


def write_experts_gguf(path: Path, typ: str, layers: int, moe_layers: list[int], e: int, h: int, i: int,
                       arch: str = "qwen3moe", seed: int = 0, log=print) -> Path:
    """Writes the experts of `moe_layers` (of a model of `layers` decoder layers) as `typ` blocks to
    `path`; block_count = `layers` (the engine checks it against the model). Returns `path`."""
    import gguf

    tid = gq.type_id(typ)
    gq.row_bytes(tid, h), gq.row_bytes(tid, i)  # a shape the type cannot hold: its error before the file
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(layers)
    w.add_embedding_length(h)
    w.add_expert_count(e)
    w.add_expert_feed_forward_length(i)
    specs = expert_tensors(moe_layers, e, h, i)
    raw = gguf.GGMLQuantizationType(tid)
    for name, n, k in specs:
        rb = gq.row_bytes(tid, k)
        w.add_tensor_info(name, (e, n, rb), np.dtype(np.uint8), e * n * rb, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    g = torch.Generator().manual_seed(seed)
    t0, total = time.perf_counter(), 0
    for j, (_name, n, k) in enumerate(specs):
        blocks = gq.random_blocks(tid, e * n, k, generator=g).view(e, n, -1).numpy()
        w.write_tensor_data(blocks)
        total += blocks.nbytes
        if log and (j + 1) % 3 == 0 and (j + 1) // 3 % 8 == 0:
            log(f"gguf experts: {(j + 1) // 3}/{len(moe_layers)} layers, {total / 1e9:.1f} GB, "
                f"{time.perf_counter() - t0:.0f} s", flush=True)
    w.close()
    if log:
        log(f"gguf experts: {path} written, {len(moe_layers)} layers of {typ}, {total / 1e9:.2f} GB in "
            f"{time.perf_counter() - t0:.1f} s", flush=True)
    return path
