"""Where a CPU-only decode step's wall time goes (bench_cpu_decode.py --split): wall clock around each
call of the step's parts, exclusive of the parts nested in it, per decode step.

    split = DecodeSplit(llm)             # wraps the engine's, runner's and model's calls (instance attributes)
    split.start(); ...decode steps...; res = split.stop(steps)  # {"per_step_us": {...}, "calls_per_step": {...}}
    split.remove()                       # the model's own forwards back

Categories (microseconds per decode step, exclusive):
  experts_native      the pool's MoE task phases (native phase profile: route .. reduce)
  experts_handoff     the wait for an expert task beyond its phases (queueing, the leader's pickup, the
                      waiter's wake-up)
  experts_glue        CPUExperts.forward's Python (copies, checks, task struct, submit)
  dense_attn_proj     qkv_proj + o_proj (native dense GEMV or torch), dense_router the router GEMV,
                      dense_mlp the dense / shared MLPs, lm_head the output layer
  attention           the attention layer itself without its projections (native decode attention or torch ops)
  norms               RMSNorm / add_norm calls (the residual adds are fused into them)
  router_topk         softmax / top-k of the router logits (moe.routing.route)
  embedding, sampling, prepare (host lists -> tensors), engine (scheduler, token bookkeeping),
  layer_native        the one-call layer (cpu/layer_decode.py: norms, qkv, attention, o_proj and the router GEMV in
                      one native call; memory-bound: those matrices), and with its MoE block inside (moe_enabled) the
                      routing: that block's expert task phases are moved from here to experts_native; the
                      stacked call (every layer in one call, with layer 0's input norm and the final norm) too
  glue_model / glue_layer / glue_moe / glue_runner: Python and torch dispatch between the calls above.
"Memory-bound" times (bytes / the stream-read bandwidth given to stop()) are printed beside the
experts and dense rows. The wrappers cost ~1 us a call (~100 calls a step): compare step_us with the
uninstrumented step time of the same run.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import torch

_ns = time.perf_counter_ns


class DecodeSplit:
    """Exclusive wall time per category over the decode steps between start() and stop()."""

    def __init__(self, llm) -> None:
        self.eng = eng = llm.engine
        self.runner = runner = eng.runner
        self.model = model = runner.model
        self.on = False
        self.t: dict[str, int] = collections.defaultdict(int)
        self.n: dict[str, int] = collections.defaultdict(int)
        self._stack: list[int] = []
        self._undo: list[Callable[[], None]] = []
        self.bytes: dict[str, int] = collections.defaultdict(int)  # weight bytes a step reads per category
        self.part_bytes: dict[str, int] = collections.defaultdict(int)  # ... per one-call layer part (bf16 weights)
        self._wrap(eng, "step", "engine")
        self._wrap(eng, "_sample", "sampling")
        self._wrap(runner, "prepare", "prepare")
        self._wrap(runner, "forward", "glue_runner")
        self._wrap(model, "forward", "glue_model")
        self._wrap(model.model.embed_tokens, "forward", "embedding")
        ld = getattr(runner, "layer_decode", None)
        if ld is not None:  # the fused attention half: norms, qkv, attention, o_proj, router in one native call
            self._wrap(ld, "_run", "layer_native")
            self._wrap(ld, "_run_stack", "layer_native")  # every layer in one call (+ layer 0's and the final norm)
        self._linear(model.lm_head, "lm_head")
        self._norm(model.model.norm)
        import hybridmoe.moe.layer as moe_layer

        orig_route = moe_layer.route
        moe_layer.route = self._timed(orig_route, "router_topk")
        self._undo.append(lambda: setattr(moe_layer, "route", orig_route))
        for layer in model.model.layers:
            self._wrap(layer, "forward", "glue_layer")
            self._norm(layer.input_layernorm)
            self._norm(layer.post_attention_layernorm)
            attn = layer.self_attn
            self._wrap(attn, "forward", "attention")
            for name in ("qkv_proj", "o_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj"):
                if isinstance(getattr(attn, name, None), torch.nn.Linear):
                    self._linear(getattr(attn, name), "dense_attn_proj")
                    self.part_bytes[name] += getattr(attn, name).weight.nbytes
            ffn = getattr(layer, layer.ffn_name)
            if not layer.is_moe:
                self._mlp(ffn)
                continue
            self._wrap(ffn, "forward", "glue_moe")
            self._wrap(ffn, "forward_logits", "glue_moe")
            gate = getattr(ffn, ffn.gate_name)
            self._wrap(gate, "forward", "dense_router")
            self.bytes["dense_router"] += gate.weight.nbytes
            self.part_bytes["router"] += gate.weight.nbytes
            if ffn.has_shared:
                self._mlp(getattr(ffn, ffn.shared_name))
            ex = ffn.experts
            self._wrap(ex, "forward", "experts_glue")
            self._wrap(ex, "forward_with", "experts_glue")
            cpu = getattr(ex, "cpu", None) or ex  # HybridExperts holds its CPUExperts in .cpu
            inner = getattr(cpu, "layer", None)
            if inner is not None and hasattr(inner, "sync"):
                self._wrap(inner, "sync", "experts_wait")
                self._wrap(inner, "run", "experts_wait")  # the synchronous path (submit + wait in one call)
                packed = getattr(inner, "packed", None)
                if packed is not None and hasattr(packed, "tensors"):
                    per = sum(t.nbytes for t in packed.tensors().values()) // packed.num_experts
                    self.bytes["experts"] += per * ffn.top_k

    # ---- wrapping ----
    def _timed(self, fn: Callable, cat: str) -> Callable:
        def run(*a, **k):
            if not self.on:
                return fn(*a, **k)
            st = self._stack
            st.append(0)
            t0 = _ns()
            try:
                return fn(*a, **k)
            finally:
                dt = _ns() - t0
                child = st.pop()
                self.t[cat] += dt - child
                self.n[cat] += 1
                if st:
                    st[-1] += dt
        return run

    def _wrap(self, obj, attr: str, cat: str) -> None:
        if not hasattr(obj, attr):
            return
        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, self._timed(getattr(obj, attr), cat))
        self._undo.append(lambda: setattr(obj, attr, old) if had else delattr(obj, attr))

    def _linear(self, mod, cat: str) -> None:
        self._wrap(mod, "forward", cat)
        self.bytes[cat] += mod.weight.nbytes

    def _mlp(self, mlp) -> None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            self._linear(getattr(mlp, name), "dense_mlp")

    def _norm(self, norm) -> None:
        self._wrap(norm, "forward", "norms")
        self._wrap(norm, "add_norm", "norms")

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    # ---- measuring ----
    def start(self) -> None:
        from hybridmoe.cpu import native

        self.t.clear()
        self.n.clear()
        native.profile(reset=True)
        if hasattr(native, "layer_profile"):
            native.layer_profile(reset=True)
        self.on = True
        self._t0 = _ns()

    def stop(self, steps: int, stream_read_bps: float | None = None) -> dict:
        """Per-step averages over `steps` decode steps (the number of engine.step calls timed)."""
        from hybridmoe.cpu import native

        wall = _ns() - self._t0
        self.on = False
        prof = native.profile(reset=True)
        parts = native.layer_profile(reset=True) if hasattr(native, "layer_profile") else {}
        t = dict(self.t)
        native_ns = int(1e9 * sum(v for k, v in prof.items() if k != "tasks"))
        wait = t.pop("experts_wait", 0)
        t["experts_native"] = min(native_ns, wait)
        t["experts_handoff"] = wait - t["experts_native"]
        inside = min(native_ns - t["experts_native"], t.get("layer_native", 0))  # tasks run inside the layer call
        if inside > 0:
            t["layer_native"] -= inside
            t["experts_native"] += inside
        per = {k: v / steps / 1e3 for k, v in sorted(t.items(), key=lambda kv: -kv[1])}
        res = {"steps": steps, "step_us": wall / steps / 1e3, "sum_us": sum(per.values()), "per_step_us": per,
               "calls_per_step": {k: v / steps for k, v in sorted(self.n.items())},
               "native_tasks_per_step": prof["tasks"] / steps,
               "native_phases_us": {k: 1e6 * v / steps for k, v in prof.items() if k != "tasks"},
               "bytes_per_step": dict(self.bytes),
               # inside the one-call layers (csrc/layer_decode.cpp): each part with its pool phase's start and barrier
               "layer_parts_us": {k: 1e6 * v / steps for k, v in parts.items() if k != "calls"},
               "layer_calls_per_step": parts.get("calls", 0) / steps}
        if stream_read_bps:
            res["memory_bound_us"] = {k: b / stream_read_bps * 1e6 for k, b in self.bytes.items()}
            res["layer_parts_memory_bound_us"] = {k: b / stream_read_bps * 1e6 for k, b in self.part_bytes.items()}
        return res


def print_split(res: dict, label: str = "") -> None:
    """The split as a table: category, us per step, share of the step, memory-bound us where known."""
    mb = res.get("memory_bound_us", {})
    mb_of = {"experts_native": mb.get("experts"), "dense_attn_proj": mb.get("dense_attn_proj"),
             "dense_router": mb.get("dense_router"), "dense_mlp": mb.get("dense_mlp"), "lm_head": mb.get("lm_head"),
             "layer_native": (mb.get("dense_attn_proj") or 0) + (mb.get("dense_router") or 0)}
    print(f"time split{(' ' + label) if label else ''}: {res['step_us']:.0f} us a step (instrumented), "
          f"{res['native_tasks_per_step']:.1f} expert tasks a step")
    for k, v in res["per_step_us"].items():
        bound = mb_of.get(k)
        extra = f"  (memory-bound {bound:.0f} us)" if bound else ""
        calls = res["calls_per_step"].get(k, res["calls_per_step"].get("experts_wait", 0) if k.startswith("experts_")
                                          else 0)
        print(f"  {k:<18} {v:>9.1f} us {100 * v / res['step_us']:>5.1f}%  {calls:>5.1f} calls{extra}")
        if k == "layer_native" and res.get("layer_calls_per_step"):
            pmb = res.get("layer_parts_memory_bound_us", {})
            names = {"qkv": "qkv_proj", "o_proj": "o_proj", "router": "router"}
            for part, us in res["layer_parts_us"].items():
                b = pmb.get(names.get(part, ""))
                extra = f"  (memory-bound {b:.0f} us, bf16 weights)" if b else ""
                print(f"    {part:<16} {us:>9.1f} us{extra}")
