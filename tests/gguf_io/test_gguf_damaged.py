"""Damaged GGUF files are refused at startup with one line naming the file and the tensor, never
served with weights read from the wrong bytes.

Each case edits one field of the tensor infos of the session's tiny Qwen3-MoE GGUF in place (found
through the gguf package's reader, as a damaged download or a buggy writer would leave it). Before
gguf/open_part.py, the offset and type cases loaded and generated text from other tensors' bytes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridmoe import LLM
from hybridmoe.config import ConfigError
from hybridmoe.gguf.reader import GGUFModel


def _damaged(src: Path, out: Path, tensor: str, part: str, value: int) -> Path:
    """A copy of `src` with tensor info field `part` ("type" or "offset") of `tensor` set to `value`."""
    from gguf import GGUFReader

    r = GGUFReader(str(src), "r")
    t = next(t for t in r.tensors if t.name == tensor)
    field = t.field.parts[-1] if part == "offset" else t.field.parts[-2]
    at = field.ctypes.data - r.data.ctypes.data
    data = bytearray(src.read_bytes())
    data[at:at + field.nbytes] = np.array([value], dtype=field.dtype).tobytes()
    out.write_bytes(bytes(data))
    return out


def _offset(src: Path, tensor: str) -> int:
    from gguf import GGUFReader

    return int(next(t for t in GGUFReader(str(src), "r").tensors if t.name == tensor).field.parts[-1][0])


# (tensor, field, value or a function of the file giving it, the words the error must contain, the
# tensor named in it: the gap case names the tensor after the gap)
CASES = {
    "offset_of_another_tensor": ("blk.1.attn_v.weight", "offset", lambda f: _offset(f, "blk.1.attn_k.weight"),
                                 "share data bytes", "blk.1.attn_v.weight"),
    "offset_wrapping_around": ("blk.1.attn_q_norm.weight", "offset", 2**64 - 1, "is not a multiple of the alignment",
                               "blk.1.attn_q_norm.weight"),
    # aligned and wrapping to 4096 bytes before the data section: the package reads the header as weights
    "offset_wrapping_into_the_header": ("blk.2.ffn_up_exps.weight", "offset", 2**64 - 4096, "past the end",
                                        "blk.2.ffn_up_exps.weight"),
    "offset_misaligned": ("blk.0.ffn_down_exps.weight", "offset", lambda f: _offset(f, "blk.0.ffn_down_exps.weight") + 8,
                          "is not a multiple of the alignment", "blk.0.ffn_down_exps.weight"),
    "offset_past_the_end": ("blk.2.ffn_up_exps.weight", "offset", 2**40, "past the end", "blk.2.ffn_up_exps.weight"),
    "type_smaller": ("blk.1.attn_k.weight", "type", 3, "more than the alignment padding", None),  # F16 -> Q4_1
    "type_larger": ("blk.0.attn_q.weight", "type", 0, "share data bytes", "blk.0.attn_q.weight"),  # F16 -> F32
    "type_unchanged": ("blk.2.attn_q_norm.weight", "type", 0, None, None),  # F32 already: the control
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_tensor_info_is_one_clear_error(case, qwen3_gguf, tmp_path):
    _, gguf, _ = qwen3_gguf
    tensor, part, value, words, named = CASES[case]
    bad = _damaged(gguf, tmp_path / "bad.gguf", tensor, part, value(gguf) if callable(value) else value)
    if words is None:  # the control: the same edit that changes nothing loads and serves
        assert GGUFModel.open(bad).tensor(tensor).type == 0
        return
    with pytest.raises(ConfigError) as e:
        LLM(str(bad), device="cpu", progress=False)
    msg = str(e.value)
    assert "bad.gguf" in msg and words in msg and "\n" not in msg, msg
    assert named is None or named in msg, msg
    with pytest.raises(ConfigError, match=words):  # the LLAMAFILE experts' reader refuses it too
        GGUFModel.open(bad)


def test_undamaged_file_passes_the_layout_check(qwen3_gguf):
    _, gguf, _ = qwen3_gguf
    assert len(GGUFModel.open(gguf).tensors) > 10


def test_a_tensor_in_two_split_parts_is_refused(tmp_path):
    from gguf import GGUFWriter

    for i in (1, 2):
        w = GGUFWriter(str(tmp_path / f"m-{i:05d}-of-00002.gguf"), "qwen3moe")
        w.add_tensor("token_embd.weight", np.full((4, 8), i, dtype=np.float32))
        w.add_tensor(f"only_in_{i}.weight", np.zeros((2, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    with pytest.raises(ConfigError, match=r"m-00002-of-00002.gguf: tensor token_embd.weight is also in .*m-00001"):
        GGUFModel.open(tmp_path / "m-00001-of-00002.gguf")


def test_generate_on_a_damaged_gguf_exits_2_with_one_line(qwen3_gguf, tmp_path):
    _, gguf, _ = qwen3_gguf
    bad = _damaged(gguf, tmp_path / "bad.gguf", "blk.1.attn_v.weight", "offset", _offset(gguf, "blk.1.attn_k.weight"))
    p = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "generate", "--device", "cpu", "--model-path", str(bad),
                        "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("hybridmoe generate: error: ") and "share data bytes" in lines[0], lines
