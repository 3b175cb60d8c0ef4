"""Routed-expert compute: the interface (experts.py), the MoE block (layer.py) and the backends.

The built-in experts backends are registered here by name and imported on first use, so the
interface imports none of them and a missing Triton makes only "triton" unavailable.
"""

from hybridmoe.moe.experts import EXPERTS_BACKENDS

EXPERTS_BACKENDS.register("torch", "hybridmoe.moe.torch_experts:make_torch_experts")
EXPERTS_BACKENDS.register("triton", "hybridmoe.moe.triton_experts:make_triton_experts")
EXPERTS_BACKENDS.register("cpu", "hybridmoe.moe.cpu_experts:make_cpu_experts")
EXPERTS_BACKENDS.register("hybrid", "hybridmoe.moe.hybrid:make_hybrid_experts")
