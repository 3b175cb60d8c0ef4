"""Checkpoint reads that bypass the mmap (weights/readahead.py, SafetensorsIndex.fill): the header
parser against safetensors, direct reads against get(), the fallbacks, truncated files, and the
layer read-ahead's byte ranges."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hybridmoe.weights.loader import CheckpointError, SafetensorsIndex
from hybridmoe.weights.readahead import LayerReadahead, merged, read_into, tensor_spans


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(37, 24, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(13, 24, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(24, generator=g),
        "model.layers.1.self_attn.q_proj.weight": torch.randn(5, 24, generator=g).half(),
        "model.layers.1.mlp.experts.3.down_proj.weight": torch.randn(24, 7, generator=g).to(torch.bfloat16),
        "model.layers.10.mlp.gate.weight": torch.randn(3, 24, generator=g),
    }


@pytest.fixture
def ckpt(tmp_path):
    t = _tensors()
    names = sorted(t)
    save_file({k: t[k] for k in names[:3]}, tmp_path / "a.safetensors")
    save_file({k: t[k] for k in names[3:]}, tmp_path / "b.safetensors")
    return tmp_path, t


def test_spans_match_safetensors(ckpt):
    root, t = ckpt
    for f in ("a.safetensors", "b.safetensors"):
        spans = tensor_spans(root / f)
        raw = (root / f).read_bytes()
        for name, sp in spans.items():
            want = t[name]
            assert sp.shape == tuple(want.shape)
            assert raw[sp.start:sp.end] == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_fill_reads_the_stored_bytes(ckpt):
    root, t = ckpt
    idx = SafetensorsIndex(str(root))
    for name, want in t.items():
        dst = torch.full_like(want, 7)
        idx.fill(name, dst)
        assert torch.equal(dst, want), name
        # a view of rows (the expert stacks are filled this way)
        big = torch.zeros(3, *want.shape, dtype=want.dtype)
        idx.fill(name, big[1])
        assert torch.equal(big[1], want) and not big[0].any() and not big[2].any()
    assert idx._fds  # the direct path ran
    idx.close()


def test_fill_falls_back_for_other_dtypes_and_layouts(ckpt):
    root, t = ckpt
    idx = SafetensorsIndex(str(root))
    name = "model.layers.0.input_layernorm.weight"  # stored f32
    dst = torch.empty(24, dtype=torch.bfloat16)
    idx.fill(name, dst)
    assert torch.equal(dst, t[name].to(torch.bfloat16))
    name = "model.embed_tokens.weight"
    dst = torch.empty(24, 37, dtype=torch.bfloat16).t()  # not contiguous
    idx.fill(name, dst)
    assert torch.equal(dst, t[name])
    with pytest.raises(CheckpointError, match="has shape"):
        idx.fill(name, torch.empty(36, 24, dtype=torch.bfloat16))
    assert not idx._fds  # none of these read the file directly


def test_truncated_file_is_named(ckpt):
    root, t = ckpt
    f = root / "b.safetensors"
    spans = tensor_spans(f)
    last = max(spans, key=lambda n: spans[n].end)
    weight_map = {n: ("b" if n in spans else "a") + ".safetensors" for n in t}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    data = f.read_bytes()
    idx = SafetensorsIndex(str(root))
    idx.fill(last, torch.empty_like(t[last]))  # opens the file while it is whole
    f.write_bytes(data[:-40])  # then it shrinks: the direct read meets its end
    with pytest.raises(CheckpointError, match=r"b\.safetensors: tensor .* cannot be read: the file ends"):
        idx.fill(last, torch.empty_like(t[last]))
    idx = SafetensorsIndex(str(root))  # opened truncated: safetensors refuses its header
    with pytest.raises(CheckpointError, match=r"b\.safetensors: not a readable safetensors file"):
        idx.fill(last, torch.empty_like(t[last]))


def test_read_into_stops_at_the_end_of_the_file(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(100)))
    fd = os.open(f, os.O_RDONLY)
    try:
        dst = torch.empty(30, dtype=torch.uint8)
        read_into(fd, 10, 40, dst)
        assert dst.tolist() == list(range(10, 40))
        with pytest.raises(EOFError, match="ends at byte 100"):
            read_into(fd, 90, 120, dst)
    finally:
        os.close(fd)


def test_merged():
    assert merged([]) == []
    assert merged([(10, 20), (0, 5), (100, 200)], gap=50) == [(0, 20), (100, 200)]
    assert merged([(0, 10), (5, 8), (12, 30)], gap=1) == [(0, 10), (12, 30)]
    assert merged([(0, 10), (5, 8), (12, 30)], gap=3) == [(0, 30)]


def test_layer_readahead_reads_each_layers_bytes(ckpt):
    root, t = ckpt
    idx = SafetensorsIndex(str(root))
    size = {n: t[n].nbytes for n in t}
    ra = LayerReadahead(idx.file_of)
    ra.layer(1)
    ra.close()
    # layer 1's two tensors lie in one file, less than the merge gap apart: one range covering both
    assert ra.ahead_bytes >= size["model.layers.1.self_attn.q_proj.weight"] + size[
        "model.layers.1.mlp.experts.3.down_proj.weight"]
    assert ra.ahead_bytes < sum(size.values())
    ra = LayerReadahead(idx.file_of, skip=".experts.")
    for i in (0, 1, 2, 10, 99):  # 2 and 99: no such layer
        ra.layer(i)
    ra.close()
    kept = ("model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.layers.10.mlp.gate.weight")
    assert ra.ahead_bytes == sum(size[n] for n in kept)  # each alone in its range: the experts skipped
