"""A GGUF model's tensors under their Hugging Face names, dequantized on read: the loader's
checkpoint index for `--model FILE.gguf` (weights/loader.py uses it in place of SafetensorsIndex).

    w = GGUFWeights(GGUFModel.open(path))
    w.fill("model.layers.0.self_attn.q_proj.weight", dst)   # dequantized, converted to dst's dtype
    w.fill("model.layers.0.mlp.experts.3.up_proj.weight", dst)  # one expert of blk.0.ffn_up_exps

q/k rows of a llama-architecture file are un-permuted (gguf/names.py); a deepseek2 file's split
attn_k_b / attn_v_b are put together as kv_b_proj (gguf/deepseek2.py). A missing tensor or a shape
that does not fit is a GGUFError naming the file and both names.
"""

from __future__ import annotations

import torch

from hybridmoe.cpu import gguf_quant
from hybridmoe.gguf.deepseek2 import kv_b_from_split
from hybridmoe.gguf.names import PERMUTED_QK, gguf_name, unpermute_rows
from hybridmoe.gguf.reader import GGUFError, GGUFModel, GGUFTensor


class GGUFWeights:
    """The loader's index interface (`in`, fill, dtype_of, shape_of, file_of) over one GGUF model."""

    def __init__(self, model: GGUFModel) -> None:
        self.model = model
        self.permute = model.arch in PERMUTED_QK
        heads = model.meta(f"{model.arch}.attention.head_count")
        self.heads = int(heads) if heads is not None else None
        kv = model.meta(f"{model.arch}.attention.head_count_kv")
        self.kv_heads = int(kv) if kv is not None else self.heads
        # every Hugging Face name this file can fill (experts expanded), for the MTP note and `in`
        self.file_of: dict[str, str] = {}

    def _lookup(self, hf: str) -> tuple[GGUFTensor | SplitKVB, int | None] | None:
        m = gguf_name(hf)
        if m is None:
            return None
        if not self.model.has(m[0]):
            split = split_kv_b(self.model, m[0])  # deepseek2's newer k_b / v_b form of kv_b_proj
            return (split, None) if split is not None else None
        return self.model.tensor(m[0]), m[1]

    def __contains__(self, hf: str) -> bool:
        return self._lookup(hf) is not None

    def _get(self, hf: str) -> tuple[GGUFTensor | SplitKVB, int | None]:
        found = self._lookup(hf)
        if found is None:
            m = gguf_name(hf)
            what = f"no tensor {m[0]}" if m else "no GGUF tensor name for it"
            raise GGUFError(f"{self.model.path}: {what} (parameter {hf})")
        return found

    def shape_of(self, hf: str) -> tuple[int, ...]:
        t, e = self._get(hf)
        return t.shape[1:] if e is not None else t.shape

    def dtype_of(self, hf: str) -> torch.dtype:
        return torch.float32  # dequantized on read

    def values(self, hf: str) -> torch.Tensor:
        """The parameter as float32 (one expert of a 3-D expert tensor: only its rows dequantized)."""
        t, e = self._get(hf)
        if e is None:
            out = t.values()
        elif t.type in gguf_quant.TYPES:
            out = gguf_quant.dequantize(t.rows()[e], t.type)
        else:
            out = t.values()[e]
        if self.permute and self.heads and (".attn_q." in t.name or ".attn_k." in t.name):
            out = unpermute_rows(out, self.heads if ".attn_q." in t.name else self.kv_heads)
        return out

    def fill(self, hf: str, dst: torch.Tensor) -> None:
        v = self.values(hf)
        if tuple(v.shape) != tuple(dst.shape):
            if v.numel() != dst.numel() or v.dim() == dst.dim():  # [H] for [1, H] is fine, a transposition is not
                t, _ = self._get(hf)
                raise GGUFError(f"{t.file}: tensor {t.name} gives {hf} the shape {tuple(v.shape)}, the model "
                                f"(config) needs {tuple(dst.shape)}")
            v = v.reshape(dst.shape)
        dst.copy_(v)

    def check(self, hf: str, shape: tuple[int, ...]) -> None:
        """Parameter `hf` exists with `shape` (a [1, H] parameter may be stored as [H])."""
        got = tuple(self.shape_of(hf))
        if got != tuple(shape) and not (len(got) != len(shape) and _numel(got) == _numel(shape)):
            t, _ = self._get(hf)
            raise GGUFError(f"{t.file}: tensor {t.name} gives {hf} the shape {got}, the model (config) needs "
                            f"{tuple(shape)}")


class SplitKVB:
    """kv_b_proj of a deepseek2 file that stores attn_k_b / attn_v_b (gguf/deepseek2.py): the
    GGUFTensor interface the index reads (name, file, shape, values), assembled on read (nothing kept)."""

    def __init__(self, k_b: GGUFTensor, v_b: GGUFTensor) -> None:
        self.name = f"{k_b.name} + {v_b.name}"  # what errors name: the file has no attn_kv_b
        self.file, self.k_b, self.v_b = k_b.file, k_b, v_b
        h, lora, nope = k_b.shape
        self.shape = (h * (nope + v_b.shape[1]), lora)
        self.type = 0  # float32 once assembled
        self.type_name = f"{k_b.type_name} + {v_b.type_name} (attn_k_b + attn_v_b)"

    def values(self) -> torch.Tensor:
        k_b, v_b = self.k_b.values(), self.v_b.values()
        if k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise GGUFError(f"{self.file}: {self.k_b.name} {list(k_b.shape)} and {self.v_b.name} "
                            f"{list(v_b.shape)} do not form one kv_b_proj (heads, kv_lora_rank differ)")
        return kv_b_from_split(k_b, v_b)


def split_kv_b(model: GGUFModel, name: str) -> SplitKVB | None:
    """The split form of `blk.L.attn_kv_b.weight` when the file has attn_k_b and attn_v_b instead."""
    if not name.endswith(".attn_kv_b.weight"):
        return None
    k, v = name.replace(".attn_kv_b.", ".attn_k_b."), name.replace(".attn_kv_b.", ".attn_v_b.")
    if not (model.has(k) and model.has(v)):
        return None
    return SplitKVB(model.tensor(k), model.tensor(v))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def open_weights(path: str) -> GGUFWeights:
    return GGUFWeights(GGUFModel.open(path))
