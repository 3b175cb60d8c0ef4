"""Adapters by name, fixed slots, and the slot of each request of a batch.

Registered adapters are kept in host memory; up to `slots` (--max-loras-per-batch) of them sit in
the slot buffers of the wrapped linears and experts. A batch's adapters are copied into slots on
demand (evicting the least recently used adapter that the batch does not use): copies into
fixed buffers, never a reallocation, so CUDA graphs stay valid. Load/unload run on the engine
thread (between steps).

Legend: S slots, T tokens.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from hybridmoe.lora import targets
from hybridmoe.lora.adapter import FLOAT32_MAX, ExpertLoRA, LoRAAdapter, LoRAAdapterError, abs_max, stack_experts
from hybridmoe.lora.batch import LoRABatch
from hybridmoe.lora.linear import LoRALinear

log = logging.getLogger(__name__)


class LoRAError(ValueError):
    """A request or a load that cannot be served (unknown adapter, too many in a batch)."""


class _Prepared:
    """A registered adapter resolved against the model: host tensors by wrapped module and layer."""

    def __init__(self, adapter: LoRAAdapter, linears: dict[str, dict[int, tuple]], experts: dict[int, ExpertLoRA]):
        self.adapter, self.linears, self.experts = adapter, linears, experts


class LoRAManager:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, slots: int, max_rank: int,
                 target_paths: list[str], graph_capacity: int = 0, max_loaded: int | None = None) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.num_slots, self.max_rank = slots, max_rank
        self.max_loaded = max_loaded  # --max-loaded-loras: adapters registered at most (None: no bound)
        self.batch = LoRABatch(device, graph_capacity)
        # a graph replay's slots go to batch.graph_index from this pinned buffer, asynchronously (a pageable
        # copy synchronized the stream: with the overlap schedule the host then waited for the step in flight
        # before launching the next, which left the GPU idle for the launch); `_graph_copied` is recorded after
        # each copy, waited for before the buffer is rewritten (normally long done)
        pin = device.type == "cuda"
        self._graph_host = torch.full((self.batch.graph_index.shape[0],), -1, dtype=torch.int32, pin_memory=pin)
        self._graph_copied = torch.cuda.Event() if pin else None
        self.wrapped: dict[str, LoRALinear] = targets.wrap(model, target_paths, slots, max_rank, self.batch, dtype,
                                                           device)
        self.expert_slots: dict[int, list] = {}  # layer -> [ExpertLoRASlots | CPUExpertLoRA] (attach_experts)
        self.adapters: dict[str, _Prepared] = {}  # by key
        self.paths: dict[str, str] = {}  # by name
        self.retired: set[str] = set()  # keys of unloaded adapters that requests still use
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # loaded adapters, least recently used first
        self.free = list(range(slots))
        self.keys: dict[str, str] = {}  # name -> name#n: a reloaded adapter never shares the old one's prefix cache
        self._loads = 0

    # ---- registry (adapters are held by their load key, name#n: a request keeps the load it was made with) ----
    def names(self) -> list[str]:
        return list(self.keys)

    def has(self, name: str) -> bool:
        return name in self.keys

    def key_of(self, name: str) -> str | None:
        return self.keys.get(name)

    def check_room(self) -> None:
        """LoRAError when --max-loaded-loras adapters are loaded (checked before a new one is read)."""
        if self.max_loaded is not None and len(self.keys) >= self.max_loaded:
            raise LoRAError(f"{len(self.keys)} LoRA adapters are loaded, --max-loaded-loras {self.max_loaded}: "
                            "unload one first")

    def register(self, adapter: LoRAAdapter) -> str:
        """Validate against the model and keep (host memory); returns its key. LoRAAdapterError names the problem."""
        if adapter.name in self.keys:
            raise LoRAError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self.check_room()
        if adapter.max_rank > self.max_rank:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r} ({adapter.path}): rank {adapter.max_rank} exceeds "
                                   f"--max-lora-rank {self.max_rank}")
        linears = targets.check_targets(self.model, adapter, self.wrapped)
        experts = self._stack_experts(adapter)
        self._check_range(adapter, linears, experts)
        self._loads += 1
        key = f"{adapter.name}#{self._loads}"
        self.adapters[key] = _Prepared(adapter, linears, experts)
        self.keys[adapter.name] = key
        self.paths[adapter.name] = adapter.path
        log.info("LoRA adapter %r loaded from %s (rank %d, %d linears, %d expert layers)", adapter.name,
                 adapter.path, adapter.max_rank, sum(len(p) for p in linears.values()), len(experts))
        return key

    def _check_range(self, adapter: LoRAAdapter, linears: dict[str, dict[int, tuple]],
                     experts: dict[int, ExpertLoRA]) -> None:
        """Every value the slots will hold is finite in their dtype (a float16 server's slots overflow at 65504;
        the parts of a fused linear with different scalings hold B * s): an infinite one made every answer of
        the adapter NaN. (Float32 range and finiteness are read_adapter's checks.)"""
        limit = min(torch.finfo(self.dtype).max, FLOAT32_MAX) if self.dtype.is_floating_point else FLOAT32_MAX

        def over(t: torch.Tensor, factor: float = 1.0) -> bool:  # (a dtype that cannot exceed it is not scanned)
            return torch.finfo(t.dtype).max * factor > limit and abs_max(t) * factor > limit

        for path, parts in linears.items():
            fold = len({s for _, _, s in parts.values()}) > 1  # LoRALinear.set_slot folds s into B then
            for part, (a, b, s) in parts.items():
                if over(a) or over(b, abs(s) if fold else 1.0):
                    raise LoRAAdapterError(f"LoRA adapter {adapter.name!r} ({adapter.path}): {path} part {part}: "
                                           f"values beyond the {str(self.dtype).removeprefix('torch.')} range of "
                                           "this server's LoRA slots")
        for layer, lora in experts.items():
            if any(over(t) for t in lora.tensors()):
                raise LoRAAdapterError(f"LoRA adapter {adapter.name!r} ({adapter.path}): the experts of layer "
                                       f"{layer}: values beyond the {str(self.dtype).removeprefix('torch.')} range "
                                       "of this server's LoRA slots")

    def unregister(self, name: str, in_use: set[str]) -> None:
        """New requests can no longer name it; its weights stay while requests made with it
        (`in_use`: their keys) still run, and go at a later `collect`."""
        key = self.keys.pop(name, None)
        if key is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        del self.paths[name]
        self.retired.add(key)
        self.collect(in_use)

    def collect(self, in_use: set[str]) -> None:
        """Drop the unloaded adapters no request uses any more (their slots freed)."""
        for key in [k for k in self.retired if k not in in_use]:
            self.retired.discard(key)
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self._clear(slot)
                self.free.append(slot)
            del self.adapters[key]

    def _stack_experts(self, adapter: LoRAAdapter) -> dict[int, ExpertLoRA]:
        if not adapter.raw_experts:
            return {}
        spec = self.model.spec
        blocks = {b.layer_idx: b for b in self.model.moe_blocks()}
        out = {}
        for layer in adapter.raw_experts:
            block = blocks.get(layer)
            if block is None:
                raise LoRAAdapterError(f"{adapter.path}: expert weights for layer {layer}, which has no routed experts")
            if layer not in self.expert_slots:
                raise LoRAAdapterError(f"{adapter.path}: expert LoRA on layer {layer} is not set up on this server "
                                       "(start it with an expert adapter in --lora-paths / --kt-expert-lora-path)")
            out[layer] = stack_experts(adapter, layer, block.num_experts, spec.expert_names, self.model.config.hidden_size,
                                       block.intermediate)
            if out[layer].rank > self.max_rank:
                raise LoRAAdapterError(f"{adapter.path}: expert rank {out[layer].rank} exceeds --max-lora-rank "
                                       f"{self.max_rank}")
        return out

    # ---- slots ----
    def _clear(self, slot: int) -> None:
        for w in self.wrapped.values():
            w.clear_slot(slot)
        for parts in self.expert_slots.values():
            for p in parts:
                p.clear_slot(slot)

    def _fill(self, slot: int, prep: _Prepared) -> None:
        for path, w in self.wrapped.items():
            w.set_slot(slot, prep.linears.get(path, {}))
        for layer, parts in self.expert_slots.items():
            lora = prep.experts.get(layer)
            for p in parts:
                if lora is None:
                    p.clear_slot(slot)
                else:
                    p.set_slot(slot, lora)

    def slots_for(self, names: list[str | None]) -> list[int]:
        """The slot of each adapter key (-1 for None: the base model), loading adapters into slots as needed."""
        wanted = {n for n in names if n is not None}
        if len(wanted) > self.num_slots:
            raise LoRAError(f"{len(wanted)} LoRA adapters in one batch; --max-loras-per-batch is {self.num_slots}")
        for n in wanted:
            if n not in self.adapters:
                raise LoRAError(f"LoRA adapter {n.split('#')[0]!r} is not loaded")
            if n in self.slot_of:
                self.slot_of.move_to_end(n)
                continue
            if not self.free:  # evict the least recently used adapter this batch does not use
                victim = next(v for v in self.slot_of if v not in wanted)
                self.free.append(self.slot_of.pop(victim))
            slot = self.free.pop(0)
            try:
                self._fill(slot, self.adapters[n])
            except BaseException:  # the slot goes back (it leaked: after S failures no adapter could be served)
                self._clear(slot)
                self.free.append(slot)
                raise
            self.slot_of[n] = slot
        return [-1 if n is None else self.slot_of[n] for n in names]

    def prepare(self, reqs: list, num_tokens: list[int]) -> None:
        """An eager forward: each new token gets its request's slot."""
        keys = [getattr(r, "lora_key", None) for r in reqs]
        slots = self.slots_for(keys)
        self.batch.set([s for s, n in zip(slots, num_tokens) for _ in range(n)])
        self.batch.expert_tokens = any(k is not None and n > 0 and self.adapters[k].experts
                                       for k, n in zip(keys, num_tokens))

    def prepare_graph(self, reqs: list, bs: int) -> None:
        """A graph replay of bs rows: the fixed index buffer (padding rows: the base model)."""
        slots = self.slots_for([getattr(r, "lora_key", None) for r in reqs]) + [-1] * (bs - len(reqs))
        if self._graph_copied is not None:
            self._graph_copied.synchronize()
        self._graph_host[:bs] = torch.tensor(slots, dtype=torch.int32)
        self.batch.graph_index[:bs].copy_(self._graph_host[:bs], non_blocking=True)
        if self._graph_copied is not None:
            self._graph_copied.record()
        self.batch.set_graph(bs)

    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes) of the slot buffers (CPU share of experts: host)."""
        dev = sum(w.nbytes() for w in self.wrapped.values())
        host = 0
        for parts in self.expert_slots.values():
            for p in parts:
                n = p.nbytes() if hasattr(p, "nbytes") else 0
                if getattr(p, "gate_A", None) is not None and p.gate_A.device.type != "cpu":
                    dev += n
                else:
                    host += n
        return dev, host
