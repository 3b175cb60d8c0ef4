"""Top-k routing: softmax over the experts' logits, top-k, optional renormalization.

Legend: T tokens, E experts, K experts per token. The kernel (CUDA) and its torch reference live in
layers/fused_ops.py.
"""

from __future__ import annotations

from hybridmoe.layers.fused_ops import topk_softmax

__all__ = ["topk_softmax"]
