"""A decoder layer at decode in one native call (csrc/layer_decode.h), for the CPU-only bf16 path:
residual add + input RMSNorm, qkv GEMV, decode attention, o_proj GEMV, residual add +
post-attention RMSNorm, the MoE block's router GEMV and, where the block allows, the MoE block
itself (native softmax top-k routing, cpu/route.py, then the layer's CPU expert task). The same
native calls as the separate forwards (dense_linears.py, attn_decode.py, fused_ops.topk_softmax,
CPUMoELayer.run) in the same order, so the same results bit for bit; what goes is ~8-12 Python ->
native crossings and their wrappers per layer (on the 2-core machine, uninstrumented: ~100 us for the
attention half, ~65 us more for the MoE block's routing, CPUExperts and task set-up; ~20 us of Python
a call remain), which at 16 threads is a large share of a layer's ~1 ms.

    ld = install_layer_decode(model, dense_linears, attn_decode)   # None when no layer qualifies
    ld.enabled = False                                             # the separate forwards again
    ld.moe_enabled = False                                         # the MoE block in Python again

Applies to a decode batch of <= MAX_ROWS bf16 rows when the dense linears and the native attention
are both enabled and the layer's qkv_proj / o_proj are still the modules they were installed on
(LoRA wraps replace them: then the layer's own forward runs). The MoE block runs inside the call
when its routing is plain softmax top-k (RoutingConfig.is_plain_softmax) with no score bias, it has
no shared experts, its router is a bf16 dense linear, and its experts are still the CPUExperts they
were installed on (GGUF layers included: the same task runner; the RecordingExperts around them is
kept: the call adds its selections to the recorder's counts) with no LoRA attached, on the dense
linears' pool; otherwise the block's forward_logits runs after the call, as before.

When every decoder layer qualifies with its MoE block inside (Qwen3-MoE, Mixtral: all layers sparse,
plain softmax routing, no qkv bias, one rotary table), the model's decode step runs all of them in ONE
native call (csrc/layer_decode.h hm_layers_decode): layer 0's input norm, every layer's call chained
through one pair of buffers, the final norm; the model's forward then costs one embedding lookup and
one call instead of a Python layer loop (~110 us a layer on the 2-core machine, ~5 ms a token at 48
layers). The same calls in the same order: bit-identical to the per-layer calls (tests). Whenever
one layer does not qualify at a step (switched off, LoRA, a replaced module, more rows), the step
runs the per-layer forwards.

    ld.stack_enabled = False                                       # the per-layer calls again

Each layer's call structure is built once per row count (weights, sizes, scratch buffers); a call
sets only the inputs, this step's metadata and its fresh outputs. The returned tensors (the layer
output and the residual) are new each call, never the scratch buffers a later call overwrites.

Legend: T rows (decode sequences), H hidden, E experts, K top-k.
"""

from __future__ import annotations

import ctypes as C
from typing import NamedTuple

import torch
from torch import nn

from hybridmoe.cpu import native
from hybridmoe.cpu.attn_decode import AttnDecode, AttnDecodeLayers
from hybridmoe.cpu.dense import DenseTask, set_int8
from hybridmoe.cpu.dense_linears import DenseLinears
from hybridmoe.cpu.engine import CPUMoEError, CPUMoELayer
from hybridmoe.layers.norm import RMSNorm

MAX_ROWS = 4  # the dense linears' decode limit (dense_linears.MAX_TOKENS)
_BF16 = torch.bfloat16


class LayerDecode(C.Structure):
    """HmLayerDecode (csrc/layer_decode.h)."""

    _fields_ = [(n, C.c_void_p) for n in ("x", "res_in", "norm1_w", "res1", "h1", "norm2_w", "res2_in", "res2",
                                         "h2")] + \
        [("qkv", DenseTask), ("attn", AttnDecode), ("o", DenseTask), ("router", DenseTask)] + \
        [("T", C.c_int64), ("H", C.c_int64), ("eps1", C.c_float), ("eps2", C.c_float), ("isa", C.c_int32),
         ("pad_", C.c_int32), ("moe", native.Task), ("moe_counts", C.c_void_p), ("moe_renorm", C.c_int32),
         ("pad2_", C.c_int32)]


class DecodeStack(C.Structure):
    """HmDecodeStack (csrc/layer_decode.h)."""

    _fields_ = [(n, C.c_void_p) for n in ("x", "norm0_w", "h0", "normf_w", "res_f", "out", "positions", "slots",
                                         "block_table", "seq_lens")] + \
        [(n, C.c_int64) for n in ("ld_bt", "T", "H")] + [("eps0", C.c_float), ("epsf", C.c_float)] + \
        [("n", C.c_int32), ("pad_", C.c_int32)]


_declared = None


def _lib():
    global _declared
    lb = native.lib()
    if _declared is not lb:
        lb.hm_layer_decode.restype = C.c_int
        lb.hm_layer_decode.argtypes = [C.c_void_p, C.POINTER(LayerDecode), C.c_char_p, C.c_int]
        lb.hm_layers_decode.restype = C.c_int
        lb.hm_layers_decode.argtypes = [C.c_void_p, C.c_void_p, C.POINTER(DecodeStack), C.c_char_p, C.c_int]
        _declared = lb
    return lb


def _i(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _bf16_vec(w: torch.Tensor | None) -> bool:
    return w is not None and w.dtype == _BF16 and w.device.type == "cpu" and w.is_contiguous()


class _MoEPart(NamedTuple):
    """What a layer call needs to run its MoE block (module docstring)."""

    experts: object  # ffn.experts as installed: a CPUExperts, or the RecordingExperts around one
    cpu: object  # the CPUExperts (its .lora is checked per call)
    layer: CPUMoELayer  # its task runner (GGUFMoELayer too)
    recorder: object | None  # the ExpertDistributionRecorder counting this layer's selections, or None
    index: int  # the recorder's key for this layer


def _moe_part(ffn: nn.Module, router: nn.Linear | None, hidden: int, pool) -> _MoEPart | None:
    """How the MoE block `ffn` runs inside the layer call, or None when it cannot (module docstring)."""
    from hybridmoe.moe.cpu_experts import CPUExperts  # moe/ imports cpu/: only here, where it is needed
    from hybridmoe.moe.recorder import RecordingExperts

    routing = getattr(ffn, "routing", None)
    experts = getattr(ffn, "experts", None)
    rec = experts if isinstance(experts, RecordingExperts) else None  # always there: it counts the selections
    cpu = rec.inner if rec is not None else experts
    inner = getattr(cpu, "layer", None)
    if (router is None or router.weight.dtype != _BF16 or routing is None or not routing.is_plain_softmax
            or getattr(ffn, "score_bias", True) or getattr(ffn, "has_shared", True)
            or not isinstance(cpu, CPUExperts) or not isinstance(inner, CPUMoELayer) or inner.pool is not pool):
        return None
    p = inner.packed
    if p.hidden != hidden or router.weight.shape[0] != p.num_experts or not 1 <= routing.top_k <= min(256, p.num_experts):
        return None
    return _MoEPart(experts, cpu, inner, rec.recorder if rec is not None else None,
                    rec.layer_idx if rec is not None else -1)


class _Part(NamedTuple):
    """An installed layer, as the stacked call needs it."""

    layer: nn.Module
    attn: nn.Module
    qkv0: nn.Module  # the projections the call was installed on
    o0: nn.Module
    ffn: nn.Module
    moe: _MoEPart | None
    setup: object  # setup(t, fused) -> (LayerDecode, h1, res1, [rope cos seen]): a fresh call structure


class _Plan(NamedTuple):
    """The stacked call for one (rows, int8 linears) key: each layer's structure, chained."""

    structs: list  # LayerDecode per layer, in order
    ptrs: object  # C array of their addresses
    stack: DecodeStack  # the per-step fields are set on it before each call
    kv: list  # [the KV cache list this plan's cache addresses came from, its per-layer entries]
    counts: list  # per layer: the recorder's counts tensor its struct points at (None: no recorder)
    rope: list  # [the rope cos its tables were made from]


def _moe_ready(ffn: nn.Module, moe: _MoEPart | None) -> bool:
    """Whether `moe` can run inside the native call now: the block still holds those experts, no LoRA is
    attached to them, and their native layer is alive (the per-layer and the stacked forwards both ask)."""
    return moe is not None and ffn.experts is moe.experts and moe.cpu.lora is None and moe.layer._h is not None


def _counts(moe: _MoEPart, e: int) -> torch.Tensor | None:
    """The recorder's int64 [E] counts of this layer (made as its record() would make them), or None
    when they are not a CPU tensor the call can add to."""
    counts = moe.recorder.counts
    c = counts.get(moe.index)
    if c is None:
        c = counts[moe.index] = torch.zeros(e, dtype=torch.int64)
    ok = c.dtype == torch.int64 and c.device.type == "cpu" and c.is_contiguous() and c.numel() == e
    return c if ok else None


class LayerDecodeLayers:
    """Fused decode forwards installed on a model's qualifying decoder layers (module docstring)."""

    def __init__(self, model: nn.Module, dl: DenseLinears, ad: AttnDecodeLayers) -> None:
        self.enabled = True
        self.moe_enabled = True  # the MoE block inside the call where it qualifies
        self.stack_enabled = True  # every layer in one call where the whole model qualifies (module docstring)
        self.native_calls = 0
        self.moe_calls = 0  # calls that ran their MoE block too
        self.stack_calls = 0  # decode steps whose layers ran in one stacked call
        self.dl, self.ad = dl, ad
        self.layers: dict[int, nn.Module] = {}
        self.moe_layers: set[int] = set()  # layers whose MoE block can run inside the call
        self._step: tuple | None = None  # the current step's metadata (_step_meta)
        self._scratch: dict[tuple, torch.Tensor] = {}  # (T, role, size, dtype) -> intermediate buffer (never returned)
        self._err = C.create_string_buffer(512)
        self._parts: dict[int, _Part] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._order: list[_Part] = []  # the model's layers in order, when it is stackable
        linears = {id(m) for m in dl.modules.values()}
        attns = {id(m) for m in ad.modules.values()}
        for layer in getattr(getattr(model, "model", None), "layers", []):
            attn = getattr(layer, "self_attn", None)
            norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
            if (id(attn) in attns and id(attn.qkv_proj) in linears and id(attn.o_proj) in linears
                    and all(isinstance(n, RMSNorm) and _bf16_vec(n.weight) for n in norms)):
                self.layers[attn.layer_idx] = layer
                layer.forward = self._make_forward(layer, linears)
        self.model = model if self._stackable(model) else None
        if self.model is not None:
            torch_forward = model.forward

            def model_forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
                out = self._stack_step(input_ids, positions, ctx)
                return out if out is not None else torch_forward(input_ids, positions, ctx)

            model.forward = model_forward

    def remove(self) -> None:
        for layer in self.layers.values():
            del layer.forward
        if self.model is not None:
            del self.model.forward
            self.model = None
        self.layers = {}
        self.moe_layers = set()
        self._parts, self._plans = {}, {}

    def _run(self, d: LayerDecode) -> None:
        """The native call (a method of its own: benchmarks/decode_split.py times it)."""
        if _lib().hm_layer_decode(self.dl.pool.handle, C.byref(d), self._err, len(self._err)):
            raise CPUMoEError(self._err.value.decode())  # a RuntimeError; .token when the MoE part names one

    def _run_stack(self, plan: _Plan) -> None:
        """The stacked native call (timed by benchmarks/decode_split.py as layer_native)."""
        if _lib().hm_layers_decode(self.dl.pool.handle, plan.ptrs, C.byref(plan.stack), self._err, len(self._err)):
            raise CPUMoEError(self._err.value.decode())

    # ---- every layer in one call ----
    def _stackable(self, model: nn.Module) -> bool:
        """Whether `model`'s decode steps can run as one stacked call (module docstring): the standard
        forward, every layer installed here with its MoE block able to run inside, no qkv bias, one rope."""
        from hybridmoe.models.base import MoECausalLM  # models/ imports layers/ and cpu/: only here

        inner = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []))
        norm = getattr(inner, "norm", None)
        if (not isinstance(model, MoECausalLM) or type(model).forward is not MoECausalLM.forward or not layers
                or not isinstance(norm, RMSNorm) or not _bf16_vec(norm.weight)
                or not isinstance(getattr(inner, "embed_tokens", None), nn.Embedding)):
            return False
        order, ropes = [], set()
        for layer in layers:
            part = self._parts.get(getattr(getattr(layer, "self_attn", None), "layer_idx", -1))
            if part is None or part.layer is not layer or part.moe is None or part.qkv0.bias is not None:
                return False
            order.append(part)
            ropes.add(id(part.attn.rotary[0]))
        self._order = order
        return len(ropes) == 1

    def _plan(self, t: int) -> _Plan:
        """The stacked call's structures for t rows (built once per key, then only patched)."""
        key = (t, self.dl.int8_enabled)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        inner = self.model.model
        hidden = inner.norm.weight.shape[0]
        sout, sres, h0 = (self._buf(t, r, hidden) for r in ("stack_out", "stack_res", "stack_h0"))
        structs = []
        for i, part in enumerate(self._order):
            d, h1, res1, _ = part.setup(t, True)
            if i == 0:  # reads the normed embeddings the stacked call writes to h0 (res2_in: patched to them)
                d.x = d.h1 = d.qkv.x = h0
                d.norm1_w = None
            else:  # reads what the layer before wrote (module docstring of layer_decode.h: one pair of buffers)
                d.x, d.res_in, d.res1, d.res2_in = sout, sres, res1, res1
                d.norm1_w = part.layer.input_layernorm.weight.data_ptr()
                d.h1 = d.qkv.x = h1
            d.res2, d.moe.out, d.moe_counts = sres, sout, None
            structs.append(d)
        st = DecodeStack()
        n0 = self._order[0].layer.input_layernorm
        st.norm0_w, st.eps0, st.h0 = n0.weight.data_ptr(), n0.eps, h0
        st.normf_w, st.epsf, st.res_f = inner.norm.weight.data_ptr(), inner.norm.eps, self._buf(t, "stack_resf",
                                                                                                 hidden)
        st.T, st.H, st.n = t, hidden, len(structs)
        ptrs = (C.c_void_p * len(structs))(*[C.addressof(d) for d in structs])
        plan = self._plans[key] = _Plan(structs, ptrs, st, [None, []], [None] * len(structs), [None])
        return plan

    def _stack_step(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor | None:
        """The model's final hidden states [T, H] from one stacked call, or None: the step runs the
        per-layer forwards (some layer or input does not qualify now)."""
        meta = ctx.attn_meta
        t = input_ids.shape[0]
        if (not (self.stack_enabled and self.enabled and self.moe_enabled and self.dl.enabled and self.ad.enabled)
                or not meta.is_decode or input_ids.dim() != 1 or not 0 < t <= min(MAX_ROWS, self.dl.max_tokens)
                or not self.dl.pool.handle or getattr(ctx.backend, "name", "") != "torch"
                or input_ids.device.type != "cpu"):
            return None
        plan = self._plan(t)
        structs = plan.structs
        kv = ctx.kv_caches
        if plan.kv[0] is not kv or len(kv) != len(plan.kv[1]) or any(a is not b for a, b in zip(kv, plan.kv[1])):
            if not self._set_caches(plan, kv):
                return None
        rope = self._order[0].attn.rotary[0]
        if plan.rope[0] is not rope.cos:  # the fp32 tables of the model's rope (once, normally)
            cos, sin = self.ad._rope_tables(rope)
            for d in structs:
                d.attn.cos, d.attn.sin = cos.data_ptr(), sin.data_ptr()
            plan.rope[0] = rope.cos
        counts = plan.counts
        for i, part in enumerate(self._order):
            attn, moe = part.attn, part.moe
            if attn.qkv_proj is not part.qkv0 or attn.o_proj is not part.o0 or not _moe_ready(part.ffn, moe):
                return None
            if moe.recorder is not None and moe.recorder.counts.get(moe.index) is not counts[i]:
                c = _counts(moe, moe.layer.packed.num_experts)
                if c is None:
                    return None
                counts[i] = c
                structs[i].moe_counts = c.data_ptr()
        x = self.model.model.embed_tokens(input_ids)
        if x.dtype != _BF16 or not x.is_contiguous():
            return None
        _, _, pos, slots, bt, ld_bt, lens, _ = self._step_meta(meta, positions)
        out = torch.empty(t, x.shape[1], dtype=_BF16)
        st = plan.stack
        st.x, st.out, st.positions, st.slots, st.block_table, st.ld_bt, st.seq_lens = x.data_ptr(), out.data_ptr(), \
            pos, slots, bt, ld_bt, lens
        self._run_stack(plan)
        n = len(structs)
        self.stack_calls += 1
        self.native_calls += n
        self.moe_calls += n
        return out

    def _set_caches(self, plan: _Plan, kv: list) -> bool:
        """Point the plan's layers at the KV caches of `kv` (bf16, contiguous: else False)."""
        if len(kv) <= max(p.attn.layer_idx for p in self._order):
            return False
        for part, d in zip(self._order, plan.structs):
            k_cache, v_cache = kv[part.attn.layer_idx][:2]
            if k_cache.dtype != _BF16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                return False
            d.attn.k_cache, d.attn.v_cache, d.attn.S = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1]
        plan.kv[0], plan.kv[1] = kv, list(kv)
        return True

    def _buf(self, t: int, role: str, n: int, dtype: torch.dtype = _BF16) -> int:
        """Address of a scratch buffer [t, n] shared by the layers' calls (they run one at a time)."""
        key = (t, role, n, dtype)
        b = self._scratch.get(key)
        if b is None:
            b = self._scratch[key] = torch.empty(t, n, dtype=dtype)
        return b.data_ptr()

    def _step_meta(self, meta, positions: torch.Tensor) -> tuple:
        """This step's (meta, positions, then the addresses of the positions, slots, block table, its row
        stride and the lengths in the kernel's dtypes, then those tensors, kept alive), once per step."""
        st = self._step
        if st is None or st[0] is not meta or st[1] is not positions:
            bt = meta.block_table
            if bt.dtype != torch.int32 or bt.stride(-1) != 1:
                bt = bt.to(torch.int32).contiguous()
            pos, slots, lens = _i(positions, torch.int64), _i(meta.slot_mapping, torch.int64), _i(meta.seq_lens,
                                                                                                    torch.int32)
            st = self._step = (meta, positions, pos.data_ptr(), slots.data_ptr(), bt.data_ptr(), bt.stride(0),
                               lens.data_ptr(), (pos, slots, bt, lens))
        return st

    def _make_forward(self, layer: nn.Module, linears: set[int]):
        torch_forward = layer.forward
        attn = layer.self_attn
        qkv0, o0 = attn.qkv_proj, attn.o_proj
        ffn = getattr(layer, layer.ffn_name)
        gate = getattr(ffn, ffn.gate_name, None) if hasattr(ffn, "forward_logits") else None
        router = gate if isinstance(gate, nn.Linear) and id(gate) in linears and gate.bias is None else None
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        nq, nattn = qkv0.weight.shape[0], attn.num_heads * attn.head_dim
        hidden = o0.weight.shape[0]
        moe = _moe_part(ffn, router, hidden, self.dl.pool)
        if moe is not None:
            self.moe_layers.add(attn.layer_idx)
        # (T, MoE inside, int8 linears) -> (LayerDecode, h1, res1 addresses, [the rope cos its tables were made from])
        calls: dict[tuple[int, bool], tuple] = {}
        bias32: list = [None, None]  # (key of the qkv bias it was made from, fp32 copy)

        def setup(t: int, fused: bool) -> tuple:
            """The call structure for t rows: every field that does not change between calls."""
            d = LayerDecode()
            d.isa, d.eps1, d.eps2, d.H, d.T = self.dl.isa_code, n1.eps, n2.eps, hidden, t
            h1, res1, qkv, att, o = (self._buf(t, r, n) for r, n in (("h1", hidden), ("res1", hidden), ("qkv", nq),
                                                                      ("attn", nattn), ("o", hidden)))
            d.norm2_w = n2.weight.data_ptr()
            wq, wo = qkv0.weight, o0.weight
            q = d.qkv
            q.w, q.ldw, q.ldx, q.out, q.T, q.N, q.K, q.out_dtype, q.ldo = wq.data_ptr(), wq.stride(0), hidden, qkv, t, \
                nq, wq.shape[1], 1, nq
            a = d.attn
            a.Hq, a.Hkv, a.D, a.eps, a.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rms_eps, attn.scale
            a.ld_qkv, a.ld_out, a.qkv, a.out, a.B = nq, nattn, qkv, att, t
            a.q_norm = attn.q_norm.weight.data_ptr() if attn.qk_norm else None
            a.k_norm = attn.k_norm.weight.data_ptr() if attn.qk_norm else None
            ow = d.o
            ow.w, ow.ldw, ow.x, ow.ldx, ow.out, ow.ldo, ow.T = wo.data_ptr(), wo.stride(0), att, nattn, o, hidden, t
            ow.N, ow.K, ow.out_dtype = hidden, nattn, 1
            set_int8(q, self.dl.int8_of(qkv0))  # --cpu-dense-weights int8: the same copies as the separate calls
            set_int8(ow, self.dl.int8_of(o0))
            r = d.router
            if router is not None and router.weight.dtype == _BF16:
                wr = router.weight
                r.w, r.ldw, r.ldx, r.ldo, r.T = wr.data_ptr(), wr.stride(0), hidden, wr.shape[0], t
                r.N, r.K, r.out_dtype = wr.shape[0], wr.shape[1], 1
            else:
                r.N = 0
            if fused:  # h2 and the logits stay inside the call: scratch; the output is new each call
                k = ffn.routing.top_k
                d.h2 = r.x = self._buf(t, "h2", hidden)
                r.out = self._buf(t, "logits", r.N)
                m = d.moe
                m.layer, m.x, m.T, m.K = moe.layer._h, d.h2, t, k
                m.ids, m.weights = self._buf(t, "ids", k, torch.int32), self._buf(t, "weights", k, torch.float32)
                m.x_dtype, m.ids_dtype, m.out_dtype, m.accumulate = native.DT_BF16, 0, native.DT_BF16, 0
                d.moe_renorm = int(bool(ffn.routing.renormalize))
            return d, h1, res1, [None]

        self._parts[attn.layer_idx] = _Part(layer, attn, qkv0, o0, ffn, moe, setup)

        def forward(x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx) -> tuple:
            meta = ctx.attn_meta
            t = x.shape[0]
            if (not (self.enabled and self.dl.enabled and self.ad.enabled) or not meta.is_decode
                    or attn.qkv_proj is not qkv0 or attn.o_proj is not o0 or x.dtype != _BF16 or x.device.type != "cpu"
                    or x.dim() != 2 or not 0 < t <= min(MAX_ROWS, self.dl.max_tokens) or not x.is_contiguous()
                    or not self.dl.pool.handle or getattr(ctx.backend, "name", "") != "torch"
                    or (residual is not None and (residual.dtype != _BF16 or residual.shape != x.shape
                                                  or not residual.is_contiguous()))):
                return torch_forward(x, residual, positions, ctx)
            k_cache, v_cache = ctx.kv_caches[attn.layer_idx]
            if k_cache.dtype != _BF16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                return torch_forward(x, residual, positions, ctx)
            fused = self.moe_enabled and _moe_ready(ffn, moe)
            counts = None
            if fused and moe.recorder is not None:
                counts = _counts(moe, moe.layer.packed.num_experts)
                fused = counts is not None
            key = (t, fused, self.dl.int8_enabled)
            hit = calls.get(key)
            if hit is None:
                hit = calls[key] = setup(t, fused)
            d, h1, res1, seen = hit
            _, _, pos, slots, bt, ld_bt, lens, _ = self._step_meta(meta, positions)
            res2 = torch.empty(t, hidden, dtype=_BF16)
            d.res2 = res2.data_ptr()
            if residual is None:  # the first layer: its input norm as the layer's own forward does it
                normed = n1(x)
                d.x = d.h1 = d.qkv.x = normed.data_ptr()
                d.norm1_w, d.res2_in = None, x.data_ptr()
            else:
                d.x, d.res_in, d.norm1_w, d.res1, d.res2_in = x.data_ptr(), residual.data_ptr(), n1.weight.data_ptr(), \
                    res1, res1
                d.h1 = d.qkv.x = h1
            b = qkv0.bias
            if b is not None:
                bkey = (b.data_ptr(), b._version)
                if bias32[0] != bkey:
                    bias32[0], bias32[1] = bkey, b.detach().float().contiguous()
                d.qkv.bias = bias32[1].data_ptr()
            a = d.attn
            a.positions, a.slots, a.block_table, a.ld_bt, a.seq_lens = pos, slots, bt, ld_bt, lens
            a.k_cache, a.v_cache, a.S = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1]
            rope = attn.rotary[0]
            if seen[0] is not rope.cos:  # the fp32 tables of this rope (once, normally)
                cos, sin = self.ad._rope_tables(rope)
                a.cos, a.sin = cos.data_ptr(), sin.data_ptr()
                seen[0] = rope.cos
            if fused:
                out = torch.empty(t, hidden, dtype=_BF16)
                d.moe.out = out.data_ptr()
                d.moe_counts = counts.data_ptr() if counts is not None else None
                self._run(d)
                self.native_calls += 1
                self.moe_calls += 1
                return out, res2
            h2 = torch.empty(t, hidden, dtype=_BF16)
            d.h2 = h2.data_ptr()
            logits = None
            if d.router.N > 0:
                logits = torch.empty(t, d.router.N, dtype=_BF16)
                d.router.x, d.router.out = d.h2, logits.data_ptr()
            self._run(d)
            self.native_calls += 1
            return (ffn.forward_logits(h2, logits) if logits is not None else ffn(h2)), res2

        return forward


def install_layer_decode(model: nn.Module, dl: DenseLinears | None, ad: AttnDecodeLayers | None
                         ) -> LayerDecodeLayers | None:
    """LayerDecodeLayers on `model` (needs both the dense linears and the native attention), or None."""
    if dl is None or ad is None:
        return None
    ld = LayerDecodeLayers(model, dl, ad)
    return ld if ld.layers else None
