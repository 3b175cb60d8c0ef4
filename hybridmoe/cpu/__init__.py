"""The CPU expert engine: quantized routed experts computed by a native thread pool.

quant.py (formats, reference quantizers, packing), dequant.py (packed layout -> dense weights on any
device), reference.py (pure-torch MoE oracle), settings.py (CPUEngineSettings: the pool's tuning),
native.py (the ctypes library and its ABI), engine.py (thread pool, layers, submit/sync),
trace.py (task timelines), topology.py (cores and NUMA nodes), build.py (how the native library
is compiled), csrc/ (C++).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer, CPUThreadPool, default_pool
    from hybridmoe.cpu.native import CpuIsaError, available_isas, best_isa, resolve_isa, wait_host_functions
    from hybridmoe.cpu.quant import METHODS, PackedLayer, pack_layer
    from hybridmoe.cpu.reference import moe_reference
    from hybridmoe.cpu.settings import CPUEngineSettings

# name -> submodule: imported on first use, so `hybridmoe.cpu.settings` (the configuration's
# import) loads neither torch nor the native library
_HOME = {
    "CPUMoEError": "engine", "CPUMoELayer": "engine", "CPUThreadPool": "engine", "default_pool": "engine",
    "CpuIsaError": "native", "available_isas": "native", "best_isa": "native", "resolve_isa": "native",
    "wait_host_functions": "native", "METHODS": "quant", "PackedLayer": "quant", "pack_layer": "quant",
    "moe_reference": "reference", "CPUEngineSettings": "settings",
}

__all__ = [
    "CPUEngineSettings",
    "CPUMoEError",
    "CPUMoELayer",
    "CPUThreadPool",
    "CpuIsaError",
    "METHODS",
    "PackedLayer",
    "available_isas",
    "best_isa",
    "default_pool",
    "moe_reference",
    "pack_layer",
    "resolve_isa",
    "wait_host_functions",
]


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'hybridmoe.cpu' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hybridmoe.cpu.{home}"), name)
