"""Fused Triton MoE experts backend, registered as "triton" (in moe/__init__.py).

Legend: T tokens, H hidden size, I expert intermediate size, E experts of the layer, K top-k.

Grouped over experts in two Triton kernels (gate/up with fused SwiGLU, then down with the routing
weight), with no host synchronization, so a forward at fixed T can be captured in a CUDA graph.
See `triton_moe_kernels` for the design. Runs on CUDA (bf16/fp16, fp32 for testing), and on CPU
tensors under the Triton interpreter (TRITON_INTERPRET=1) for tests.

Options (engine-level dict): "config": a `MoEKernelConfig` forcing the tile sizes for every T.

Block-scaled fp8 experts (an fp8 checkpoint, the ExpertWeights fp8 form) stay fp8 in GPU memory (1
byte per weight + block scales) and are dequantized in registers by the same kernels (weight-only:
the result is that of the dequantized weights); where that path does not run (`fp8_experts_supported`)
they are dequantized once, at construction, to the model dtype.
"""

from __future__ import annotations

import os

import torch

from hybridmoe.moe.experts import ExpertWeights, MoEExperts
from hybridmoe.moe.options import ExpertsOptions
from hybridmoe.moe.triton_moe_kernels import MoEKernelConfig, choose_config, fp8_block_ok, fused_moe

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TritonExperts(MoEExperts):
    """Routed experts of one layer computed by the fused Triton kernels."""

    name = "triton"

    def __init__(self, weights: ExpertWeights, layer_idx: int, options: ExpertsOptions | None = None) -> None:
        if weights.is_fp8 and not fp8_experts_supported(weights):
            # dequantized once to the model dtype (the kernel's fp8 path needs sm_89+ and bk = 2^n >= 16)
            weights = weights.dequantized((options or ExpertsOptions()).compute_dtype(weights.gate_up.device))
        if weights.activation != "silu":
            raise NotImplementedError(f"triton experts: activation {weights.activation!r} not supported")
        if weights.is_fp8:  # kept as fp8 codes + block scales, dequantized in the kernels' registers
            self.gate_up_scale = weights.gate_up_scale.contiguous()  # type: ignore[union-attr]
            self.down_scale = weights.down_scale.contiguous()  # type: ignore[union-attr]
        elif weights.gate_up.dtype not in _SUPPORTED_DTYPES or weights.down.dtype != weights.gate_up.dtype:
            raise TypeError(f"triton experts: unsupported weight dtypes {weights.gate_up.dtype}/{weights.down.dtype}")
        self.weights = weights
        self.layer_idx = layer_idx
        self.gate_up = weights.gate_up.contiguous()  # [E, 2I, H]
        self.down = weights.down.contiguous()  # [E, H, I]
        self.config: MoEKernelConfig | None = options.triton_config if options is not None else None
        # expert LoRA (lora/experts.py ExpertLoRASlots), attached by the LoRA manager: the fused kernels
        # add its per-pair gate/up deltas before the activation and its down deltas after down
        self.lora = None

    def config_for(self, num_tokens: int, top_k: int) -> MoEKernelConfig:
        """Tile sizes used at this T (the forced one, a tuned one for this shape, or the heuristic)."""
        if self.config is not None:
            return self.config
        w = self.weights
        return choose_config(num_tokens, w.num_experts, top_k, w.hidden_size, w.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K] int
        topk_weights: torch.Tensor,  # [T, K] float32
    ) -> torch.Tensor:  # [T, H], dtype of x
        """Weighted sum over each token's selected experts; no host sync (graph-capturable)."""
        if x.shape[0] == 0:
            return x.new_empty((0, self.weights.hidden_size))
        w = self.weights
        lora = self.lora.pair_deltas(x, topk_ids) if self.lora is not None else None
        cfg = self.config_for(x.shape[0], topk_ids.shape[1])
        if w.is_fp8:
            return fused_moe(x, self.gate_up, self.down, topk_ids, topk_weights, cfg, gate_up_scale=self.gate_up_scale,
                             down_scale=self.down_scale, block=w.block, lora=lora)
        if x.dtype != self.gate_up.dtype:
            raise TypeError(f"triton experts: x is {x.dtype}, weights are {self.gate_up.dtype}")
        return fused_moe(x, self.gate_up, self.down, topk_ids, topk_weights, cfg, lora=lora)


def fp8_experts_supported(weights: ExpertWeights) -> bool:
    """Whether the fused kernels compute these fp8 experts as fp8: a block they take, on a GPU with
    FP8 (sm_89+), or under the Triton interpreter (tests)."""
    dev = weights.gate_up.device
    if not fp8_block_ok(weights.block):
        return False
    if dev.type == "cuda":
        return torch.cuda.get_device_capability(dev) >= (8, 9)
    return os.environ.get("TRITON_INTERPRET") == "1"


def make_triton_experts(weights: ExpertWeights, layer_idx: int, options: ExpertsOptions) -> MoEExperts:
    return TritonExperts(weights, layer_idx, options)


def _copy_bandwidth_gbs(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read and written."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def benchmark(
    token_counts: tuple[int, ...] = (1, 8, 32, 64, 1024),
    num_experts: int = 128,
    top_k: int = 8,
    hidden: int = 2048,
    inter: int = 768,
    config: MoEKernelConfig | None = None,
) -> list[dict]:
    """Times one layer on CUDA (bf16) with triton.testing.do_bench; prints us/layer and bandwidth.

    Effective bandwidth = bytes of the distinct experts touched / time, shown next to a device-to-device
    copy bandwidth (read + write) measured in the same run. "eager" includes the launch of ~15 small
    ops (routing sort etc.); "graph" replays a CUDA graph of the forward, as the engine would at decode.
    """
    import triton.testing

    from hybridmoe.moe.triton_moe_kernels import align_pairs

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dtype) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, device=dev, dtype=dtype) / inter**0.5
    layer = TritonExperts(ExpertWeights(gate_up, down), 0, {"config": config} if config else {})
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()

    copy_gbs = _copy_bandwidth_gbs(dev)
    print(f"E={num_experts} K={top_k} H={hidden} I={inter} bf16; D2D copy {copy_gbs:.0f} GB/s (read+write)")
    print(f"{'T':>6} {'experts':>7} {'MB':>8} {'eager us':>9} {'graph us':>9} {'align us':>9} "
          f"{'GB/s(graph)':>11} {'% copy':>7}")
    rows = []
    for T in token_counts:
        x = torch.randn(T, hidden, device=dev, dtype=dtype)
        ids = torch.rand(T, num_experts, device=dev).topk(top_k, dim=1).indices
        w = torch.softmax(torch.randn(T, top_k, device=dev), dim=1)
        touched = int(torch.unique(ids).numel())
        mbytes = touched * expert_bytes
        eager_ms = triton.testing.do_bench(lambda x=x, ids=ids, w=w: layer.forward(x, ids, w))
        cfg = layer.config_for(T, top_k)
        align_ms = triton.testing.do_bench(lambda ids=ids, cfg=cfg: align_pairs(ids, num_experts, cfg.block_m))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer.forward(x, ids, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer.forward(x, ids, w)
        graph_ms = triton.testing.do_bench(graph.replay)
        gbs = mbytes / graph_ms / 1e6
        rows.append({"T": T, "experts": touched, "eager_us": eager_ms * 1e3, "graph_us": graph_ms * 1e3,
                     "align_us": align_ms * 1e3, "gbs": gbs, "copy_gbs": copy_gbs})
        print(f"{T:>6} {touched:>7} {mbytes / 1e6:>8.1f} {eager_ms * 1e3:>9.1f} {graph_ms * 1e3:>9.1f} "
              f"{align_ms * 1e3:>9.1f} {gbs:>11.0f} {100 * gbs / copy_gbs:>6.0f}%")
        del graph
    return rows


if __name__ == "__main__":
    benchmark()
