"""Loading block-scaled FP8 checkpoints (DeepSeek-V3 style; weights/fp8.py has the format).

What stays FP8 and what is dequantized (decided per checkpoint tensor, so `modules_to_not_convert`
is honoured by construction: those tensors are not fp8 in the file):
  - Non-expert linears whose checkpoint weight is fp8 with a `weight_scale_inv`: on a GPU with FP8
    (sm_89+, `fp8_gemm_supported`) and a kernel-friendly block (bk a power of two >= 16) the nn.Linear
    is swapped for an `Fp8Linear` on the meta device before any memory is allocated
    (`swap_fp8_linears`); elsewhere, or with `--fp8-dequantize`, the tensor is dequantized to the
    model dtype as it is read (`Fp8Reader.fill`).
  - A fused parameter (qkv_proj from q/k/v) stays FP8 only when every part but the last is a whole
    number of bn-row blocks: the parts' scale rows then stack into the fused layer's scale rows
    (`Fp8Linear.parts`, `checkpoint_parts`). Otherwise it is dequantized (exact: each part is
    dequantized with its own scales).
  - A module that reads a child linear's `.weight` itself (not only calls it: MLA's weight absorption
    of kv_b_proj, say) lists that child in a class attribute `fp8_dense_children = ("kv_b_proj",)`;
    those children are always dequantized; without the attribute, `DENSE_CHILDREN` (MLA's
    kv_b_proj) applies. (`layers.fp8_linear.dense_weight` gives any linear's
    weight in a dtype, Fp8Linear or not.)
  - Routed experts: kept in the fp8 ExpertWeights form (codes + block scales) unless
    `--fp8-dequantize`; backends that do not compute in fp8 dequantize them (ExpertWeights.dequantized).

Legend: N rows, K columns of a weight, bn x bk the block, E experts, I expert intermediate, H hidden.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable

import torch
from torch import nn

from hybridmoe.layers.fp8_linear import Fp8Linear
from hybridmoe.weights.fp8 import FP8_DTYPES, block_dequant, scale_name

log = logging.getLogger(__name__)

# children dequantized when their parent declares no fp8_dense_children: MLA's kv_b_proj, whose weight
# layers/attention/mla.py reads for the absorbed decode (W_UK, W_UV)
DENSE_CHILDREN = ("kv_b_proj",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def fp8_block_of(config) -> tuple[int, int] | None:
    """(bn, bk) of a block-scaled fp8 checkpoint (`quantization_config.quant_method` "fp8"); None for
    an unquantized one. Other quantization methods and per-tensor fp8 are errors naming the config."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config quant_method {method!r} is not supported "
                         "(block-scaled 'fp8' is; other checkpoints must be bf16/fp16/fp32)")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"config.json: quant_method fp8 needs weight_block_size [bn, bk] (block-scaled fp8, as "
                         f"DeepSeek-V3 publishes); got {block!r}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"config.json: fp8 activation_scheme {q.get('activation_scheme')!r} is not supported "
                         "(activations are quantized per token on the fly: 'dynamic')")
    return int(block[0]), int(block[1])


def mtp_tensor_count(names: list[str], num_layers: int) -> tuple[int, list[int]]:
    """(tensors, layer ids) of the checkpoint's layers at or past num_hidden_layers: DeepSeek-V3's
    multi-token-prediction modules (num_nextn_predict_layers), which this engine does not run."""
    layers: set[int] = set()
    n = 0
    for name in names:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= num_layers:
            n += 1
            layers.add(int(m.group(1)))
    return n, sorted(layers)


class Fp8Reader:
    """Wraps a SafetensorsIndex of an fp8 checkpoint: `fill` dequantizes an fp8 tensor into a
    non-fp8 destination and copies the codes into an fp8 one; every other tensor goes through the
    index's usual checks (float dtypes, shapes)."""

    def __init__(self, index, block: tuple[int, int], error: type[Exception] = ValueError) -> None:
        # error: the loader's CheckpointError (passed in: this module must not import the loader)
        self.index, self.block, self.error = index, block, error

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def _fail(self, msg: str):
        raise self.error(msg)

    @property
    def file_of(self):
        return self.index.file_of

    def is_fp8(self, name: str) -> bool:
        return name in self.index and self.index.dtype_of(name) in FP8_DTYPES

    def _where(self, name: str) -> str:
        f = self.index.file_of.get(name)
        return f"{f.name}: tensor {name!r}" if f is not None else f"tensor {name!r}"

    def scale(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        """The checked scale_inv [ceil(N/bn), ceil(K/bk)] of fp8 weight `name` [N, K]."""
        bn, bk = self.block
        sname = scale_name(name)
        if sname not in self.index:
            self._fail(f"{self._where(name)} is fp8 but the checkpoint has no {sname!r} (block-scaled fp8 "
                        f"needs one scale per {bn}x{bk} block)")
        want = (-(-shape[0] // bn), -(-shape[1] // bk))
        s = self.index.get(sname)
        if tuple(s.shape) != want:
            self._fail(f"{self._where(sname)} has shape {tuple(s.shape)}, expected {want}: the scales of the "
                        f"{list(shape)} weight {name!r} in {bn}x{bk} blocks (weight_block_size)")
        return s

    def get_fp8(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.index.get(name, shape, allow_fp8=True)
        if t.dtype != torch.float8_e4m3fn:
            self._fail(f"{self._where(name)} has dtype {t.dtype}; block-scaled fp8 checkpoints store float8_e4m3fn")
        return t

    def fill(self, name: str, dst: torch.Tensor) -> None:
        """Copy (fp8 dst) or dequantize (any other dst) tensor `name` into dst, checking its shape."""
        if not self.is_fp8(name):
            if dst.dtype in FP8_DTYPES:  # an fp8 layer (chosen from another part's dtype) cannot take it
                self._fail(f"{self._where(name)} has dtype {self.index.dtype_of(name)}, expected float8_e4m3fn "
                            "like the other tensors of its layer")
            self.index.fill(name, dst)
            return
        w = self.get_fp8(name, tuple(dst.shape))
        if dst.dtype == torch.float8_e4m3fn:
            dst.copy_(w)
            return
        if w.dim() != 2:
            self._fail(f"{self._where(name)} is fp8 with shape {tuple(w.shape)}; block scales need a 2-D weight")
        s = self.scale(name, tuple(w.shape))
        dst.copy_(block_dequant(w.to(dst.device), s.to(dst.device), self.block))

    def fill_scale(self, weight_name: str, dst: torch.Tensor) -> None:
        """The checked scale_inv of fp8 weight `weight_name` into dst (its rows: the weight's row blocks)."""
        s = self.scale(weight_name, self.index.shape_of(weight_name))
        if tuple(s.shape) != tuple(dst.shape):
            self._fail(f"{self._where(scale_name(weight_name))} has shape {tuple(s.shape)}, expected "
                        f"{tuple(dst.shape)}")
        dst.copy_(s)


class Fp8DummyReader:
    """`--load-format dummy` with an fp8 config: random fp8 codes and scales in the checkpoint's
    layout (every linear fp8 but embeddings, LM head, norms and routers), for benchmarks."""

    CODE_STD = 64.0  # codes ~ N(0, 64) use e4m3's range well; scale = std / 64 gives weights of std `std`

    def __init__(self, dummy, block: tuple[int, int]) -> None:
        self.dummy, self.block = dummy, block

    def __contains__(self, name: str) -> bool:
        return True

    @property
    def file_of(self) -> dict:
        return {}

    def is_fp8(self, name: str) -> bool:
        return name.endswith(".weight") and not any(
            tag in name for tag in ("embed_tokens", "lm_head", "norm", ".gate.weight", "shared_expert_gate"))

    def fill(self, name: str, dst: torch.Tensor) -> None:
        if dst.dtype == torch.float8_e4m3fn:
            gen_dev = "cuda" if torch.cuda.is_available() else dst.device  # drawn on the GPU: ~100x faster
            g = torch.Generator(device=gen_dev).manual_seed(zlib.crc32(name.encode()))  # the same in every run
            step = max(1, (1 << 26) // max(1, dst[0].numel()))  # fp32 draws of <= 256 MB, not a whole stack
            for i in range(0, dst.shape[0], step):
                part = dst[i:i + step]
                part.copy_(torch.empty(part.shape, device=gen_dev).normal_(0.0, self.CODE_STD, generator=g)
                           .clamp_(-448.0, 448.0).to(torch.float8_e4m3fn))
        elif name.endswith("weight_scale_inv"):
            dst.fill_(self.dummy.std / self.CODE_STD)
        else:
            self.dummy.fill(name, dst)

    def fill_scale(self, weight_name: str, dst: torch.Tensor) -> None:
        dst.fill_(self.dummy.std / self.CODE_STD)


def swap_fp8_linears(model: nn.Module, reader, block: tuple[int, int], dtype: torch.dtype,
                     parts_of: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]) -> tuple[int, int]:
    """On the meta device: replace each nn.Linear whose checkpoint weight (or every part of a fused
    one) is fp8 by an Fp8Linear. Returns (swapped, left as nn.Linear to be dequantized)."""
    bn = block[0]
    swapped = dequant = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        parent, _, child = name.rpartition(".")
        if child in getattr(model.get_submodule(parent), "fp8_dense_children", DENSE_CHILDREN):
            continue  # its weight is read directly (not only called), e.g. absorbed into another: dequantized
        parts = parts_of(f"{name}.weight", mod.weight)
        fp8 = [reader.is_fp8(src) for src, _ in parts]
        if not any(fp8):
            continue
        rows = [v.shape[0] for _, v in parts]
        # a part that is not fp8, a 2-D split other than along rows, or a part boundary inside a
        # block: no consistent block scales for the fused weight -> dequantized at load
        if not all(fp8) or any(v.dim() != 2 or v.shape[1] != mod.in_features for _, v in parts) \
                or any(r % bn for r in rows[:-1]):
            dequant += 1
            continue
        new = Fp8Linear(mod.in_features, mod.out_features, block, bias=mod.bias is not None, dtype=dtype,
                        device="meta")
        if len(parts) > 1 or parts[0][0] != f"{name}.weight":
            new.parts = [(src, r) for (src, _), r in zip(parts, rows)]
        model.set_submodule(name, new)
        swapped += 1
    return swapped, dequant


def fp8_checkpoint_parts(model: nn.Module, name: str, param: torch.Tensor,
                         parts_of: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]):
    """(checkpoint tensor, destination) pairs of parameter `name`, with an Fp8Linear's scale rows
    split after its parts (a fused layer) and marked by a None source of the scale: the caller fills
    `scale of <weight>` with Fp8Reader.fill_scale. Yields (source, dst, is_scale)."""
    if name.endswith(".weight_scale_inv"):
        mod = model.get_submodule(name[: -len(".weight_scale_inv")])
        assert isinstance(mod, Fp8Linear)
        if mod.parts is None:
            return [(name[: -len("_scale_inv")], param, True)]
        out, row = [], 0
        for src, rows in mod.parts:
            nb = -(-rows // mod.block[0])
            out.append((src, param[row:row + nb], True))
            row += nb
        return out
    return [(src, dst, False) for src, dst in parts_of(name, param)]
