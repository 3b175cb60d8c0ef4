"""A linear layer kept in block-scaled FP8 (the checkpoint's own bytes), computed by the Triton W8A8
block GEMM (layers/fp8_kernels.py). The loader swaps it in for an nn.Linear whose checkpoint
weight is fp8 with a `weight_scale_inv` (weights/fp8_loading.py), on GPUs with FP8 (sm_89+).

Parameter names are the checkpoint's: `weight` float8_e4m3fn [N, K], `weight_scale_inv` float32
[ceil(N/bn), ceil(K/bk)], `bias` (model dtype) when the layer has one. The fp8 and fp32 tensors are
not converted by Module.to(dtype) (see `_apply`), only moved.

Legend: N out features, K in features, bn x bk the block.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers.fp8_kernels import w8a8_block_gemm, w8a8_block_gemm_ref


class Fp8Linear(nn.Module):
    """y = x @ (weight * scale_inv)^T + bias with x quantized per token group on the fly.

    `parts` (set by the loader for a fused layer such as qkv_proj): the checkpoint weights that fill
    consecutive row ranges, (name, rows); each part's scale rows then fill consecutive scale rows,
    which needs every part but the last to be a multiple of bn rows (the loader checks)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        bn, bk = block
        self.in_features, self.out_features, self.block = in_features, out_features, (int(bn), int(bk))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.parts: list[tuple[str, int]] | None = None

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # Module.to(dtype) / .half() would turn the fp8 codes and fp32 scales into the model dtype
        # (and lose the scales' precision): a probe tells a dtype conversion from a move
        # (to_empty, .to(device)); on a conversion only the bias converts, the rest only moves.
        probe = fn(torch.zeros(0, dtype=torch.float32, device=self.weight.device))
        if probe.dtype == torch.float32:
            return super()._apply(fn, recurse)
        self.weight = nn.Parameter(self.weight.to(probe.device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(self.weight_scale_inv.to(probe.device), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias), requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            y = w8a8_block_gemm(x2, self.weight, self.weight_scale_inv, self.block)
        else:  # the loader builds this module only where the kernel runs; CPU tensors: the reference
            y = w8a8_block_gemm_ref(x2, self.weight, self.weight_scale_inv, self.block)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, " \
               f"bias={self.bias is not None}"


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight of an nn.Linear or an Fp8Linear (dequantized), in `dtype`."""
    if isinstance(linear, Fp8Linear):
        from hybridmoe.weights.fp8 import block_dequant

        return block_dequant(linear.weight, linear.weight_scale_inv, linear.block).to(dtype)
    return linear.weight.to(dtype)
