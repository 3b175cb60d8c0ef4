"""The CPU expert engine: quantized routed experts computed by a native thread pool.

quant.py (formats, reference quantizers, packing), reference.py (pure-torch MoE oracle),
native.py (the ctypes library and its ABI), engine.py (thread pool, layers, submit/sync),
topology.py (cores and NUMA nodes), build.py (how the native library is compiled), csrc/ (C++).
"""

from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool, default_pool
from hybridmoe.cpu.native import CpuIsaError, available_isas, best_isa, host_functions, resolve_isa
from hybridmoe.cpu.quant import METHODS, PackedLayer, pack_layer
from hybridmoe.cpu.reference import moe_reference

__all__ = [
    "CPUMoEError",
    "CPUMoELayer",
    "CPUThreadPool",
    "CpuIsaError",
    "METHODS",
    "PackedLayer",
    "available_isas",
    "best_isa",
    "default_pool",
    "host_functions",
    "moe_reference",
    "pack_layer",
    "resolve_isa",
]
