"""GGUF reference dequantizers (hybridmoe/cpu/gguf_quant.py) against gguf.quants.dequantize, bit for bit,
on random valid blocks of every supported type (random bytes, finite fp16 scales) and on blocks from
quantizers (gguf's own for Q4_0/Q8_0, ours for the others, which gguf cannot quantize); the
activation quantization's rounding rule; and the GGUF reader on a file written with gguf's writer."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from hybridmoe.cpu import gguf_quant as gq

TYPES = sorted(gq.TYPE_IDS)
# max |w - dequant(quant(w))| / max |w| of our quantizers on Gaussian rows (measured 0.004-0.10)
QUANT_MAX_ERR = {"Q4_0": 0.10, "Q8_0": 0.01, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.03, "IQ4_XS": 0.15}


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_random_blocks_equals_gguf(name):
    g = torch.Generator().manual_seed(1)
    b = gq.random_blocks(name, 7, 768, generator=g)
    ref = quants.dequantize(b.numpy(), GGMLQuantizationType(gq.TYPE_IDS[name]))
    assert np.array_equal(gq.dequantize(b, name).numpy(), ref)


@pytest.mark.parametrize("name", TYPES)
def test_quantize_roundtrip_equals_gguf(name):
    w = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(2))
    q = gq.quantize(w, name)
    assert q.shape == (3, 5, gq.row_bytes(name, 512))
    ref = quants.dequantize(q.numpy(), GGMLQuantizationType(gq.TYPE_IDS[name]))
    mine = gq.dequantize(q, name)
    assert np.array_equal(mine.numpy(), ref)
    err = (mine - w).abs().max() / w.abs().max()
    assert err <= QUANT_MAX_ERR[name], err
    if name in ("Q4_0", "Q8_0"):  # gguf's own quantizer: the same bytes
        assert np.array_equal(q.numpy(), quants.quantize(w.numpy(), GGMLQuantizationType(gq.TYPE_IDS[name])))


def test_unsupported_type_and_bad_rows_are_clear_errors():
    with pytest.raises(ValueError, match="Q2_K|no CPU kernel"):
        gq.type_id("Q2_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        gq.row_bytes("Q4_K", 300)


def test_act_quant_q8k():
    x = torch.randn(3, 512) * torch.tensor([1.0, 1e-3, 50.0]).unsqueeze(-1)
    x[1, :256] = 0  # an all-zero block: d = 0, q = 0
    q, d = gq.quantize_act_q8k(x)
    assert q.shape == (3, 512) and d.shape == (3, 2)
    assert d[1, 0] == 0 and (q[1, :256] == 0).all()
    back = gq.act_round_q8k(x)
    blk = x.view(3, 2, 256).abs().amax(-1, keepdim=True)
    assert ((back - x.double()).abs().view(3, 2, 256) <= blk.double() / 254 * 1.0001).all()


def test_reader_views_the_file(tmp_path):
    from hybridmoe.gguf.reader import GGUFError, GGUFModel

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 1)
    rows = gq.quantize(torch.randn(2, 32, 256), "Q6_K")
    w.add_tensor("blk.0.ffn_down_exps.weight", rows.numpy(), raw_dtype=GGMLQuantizationType.Q6_K)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float16).reshape(3, 4))
    w.add_tensor("odd.weight", np.zeros((2, 84), np.uint8), raw_dtype=GGMLQuantizationType.Q2_K)  # a Q2_K row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = GGUFModel.open(tmp_path)  # the directory holding one model
    assert m.arch == "qwen3moe" and m.meta("qwen3moe.block_count") == 1
    t = m.tensor("blk.0.ffn_down_exps.weight")
    assert t.shape == (2, 32, 256) and t.type_name == "Q6_K"
    assert torch.equal(t.rows(), rows)
    assert torch.equal(m.tensor("token_embd.weight").values(), torch.arange(12.0).view(3, 4))
    with pytest.raises(GGUFError, match="odd.weight is Q2_K"):
        m.tensor("odd.weight").rows()
    with pytest.raises(GGUFError, match="no tensor blk.9"):
        m.tensor("blk.9.ffn_up_exps.weight")
    part = tmp_path / "split" / "x-00001-of-00002.gguf"
    part.parent.mkdir()
    part.write_bytes(path.read_bytes())
    with pytest.raises(GGUFError, match="incomplete; missing .*x-00002-of-00002.gguf"):
        GGUFModel.open(part)
