"""A decoder layer's attention half at decode in one native call (csrc/layer_decode.h), for the
CPU-only bf16 path: residual add + input RMSNorm, qkv GEMV, decode attention, o_proj GEMV, residual
add + post-attention RMSNorm, and the MoE block's router GEMV. The same native calls as the
separate forwards (dense_linears.py, attn_decode.py) in the same order, so the same results bit for
bit; what goes is ~8 Python -> native crossings and their wrappers per layer (~100 us a layer on the
2-core machine), which at 16 threads is a large share of a layer's ~1 ms.

    ld = install_layer_decode(model, dense_linears, attn_decode)   # None when no layer qualifies
    ld.enabled = False                                             # the separate forwards again

Applies to a decode batch of <= MAX_ROWS bf16 rows when the dense linears and the native attention
are both enabled and the layer's qkv_proj / o_proj are still the modules they were installed on
(LoRA wraps replace them: then the layer's own forward runs).

Legend: T rows (decode sequences), H hidden, E experts.
"""

from __future__ import annotations

import ctypes as C

import torch
from torch import nn

from hybridmoe.cpu import native
from hybridmoe.cpu.attn_decode import AttnDecode, AttnDecodeLayers
from hybridmoe.cpu.dense import DenseTask
from hybridmoe.cpu.dense_linears import DenseLinears
from hybridmoe.layers.norm import RMSNorm

MAX_ROWS = 4  # the dense linears' decode limit (dense_linears.MAX_TOKENS)
_BF16 = torch.bfloat16


class LayerDecode(C.Structure):
    """HmLayerDecode (csrc/layer_decode.h)."""

    _fields_ = [(n, C.c_void_p) for n in ("x", "res_in", "norm1_w", "res1", "h1", "norm2_w", "res2_in", "res2",
                                         "h2")] + \
        [("qkv", DenseTask), ("attn", AttnDecode), ("o", DenseTask), ("router", DenseTask)] + \
        [("T", C.c_int64), ("H", C.c_int64), ("eps1", C.c_float), ("eps2", C.c_float), ("isa", C.c_int32),
         ("pad_", C.c_int32)]


_declared = None


def _lib():
    global _declared
    lb = native.lib()
    if _declared is not lb:
        lb.hm_layer_decode.restype = C.c_int
        lb.hm_layer_decode.argtypes = [C.c_void_p, C.POINTER(LayerDecode), C.c_char_p, C.c_int]
        _declared = lb
    return lb


def _i(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _bf16_vec(w: torch.Tensor | None) -> bool:
    return w is not None and w.dtype == _BF16 and w.device.type == "cpu" and w.is_contiguous()


class LayerDecodeLayers:
    """Fused decode forwards installed on a model's qualifying decoder layers (module docstring)."""

    def __init__(self, model: nn.Module, dl: DenseLinears, ad: AttnDecodeLayers) -> None:
        self.enabled = True
        self.native_calls = 0
        self.dl, self.ad = dl, ad
        self.layers: dict[int, nn.Module] = {}
        self._step: tuple | None = None  # (meta, positions, pos, slots, block table, seq lens) of the current step
        self._scratch: dict[tuple, tuple] = {}  # (T, qkv, attn, H) -> intermediate buffers (never returned)
        self._err = C.create_string_buffer(512)
        linears = {id(m) for m in dl.modules.values()}
        attns = {id(m) for m in ad.modules.values()}
        for layer in getattr(getattr(model, "model", None), "layers", []):
            attn = getattr(layer, "self_attn", None)
            norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
            if (id(attn) in attns and id(attn.qkv_proj) in linears and id(attn.o_proj) in linears
                    and all(isinstance(n, RMSNorm) and _bf16_vec(n.weight) for n in norms)):
                self.layers[attn.layer_idx] = layer
                layer.forward = self._make_forward(layer, linears)

    def remove(self) -> None:
        for layer in self.layers.values():
            del layer.forward
        self.layers = {}

    def _run(self, d: LayerDecode) -> None:
        """The native call (a method of its own: benchmarks/decode_split.py times it)."""
        if _lib().hm_layer_decode(self.dl.pool.handle, C.byref(d), self._err, len(self._err)):
            raise RuntimeError(self._err.value.decode())

    def _step_meta(self, meta, positions: torch.Tensor) -> tuple:
        """This step's positions, slots, block table and lengths in the kernel's dtypes (once per step)."""
        st = self._step
        if st is None or st[0] is not meta or st[1] is not positions:
            bt = meta.block_table
            if bt.dtype != torch.int32 or bt.stride(-1) != 1:
                bt = bt.to(torch.int32).contiguous()
            st = self._step = (meta, positions, _i(positions, torch.int64), _i(meta.slot_mapping, torch.int64), bt,
                               _i(meta.seq_lens, torch.int32))
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
        d = LayerDecode()
        d.isa, d.eps1, d.eps2, d.H = self.dl.isa_code, n1.eps, n2.eps, hidden
        d.qkv.N, d.qkv.K, d.qkv.out_dtype, d.qkv.ldo = nq, qkv0.weight.shape[1], 1, nq
        d.o.N, d.o.K, d.o.out_dtype, d.o.ldo = hidden, nattn, 1, hidden
        a = d.attn
        a.Hq, a.Hkv, a.D, a.eps, a.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rms_eps, attn.scale
        a.ld_qkv, a.ld_out = nq, nattn
        bias32: list = [None, None]  # (key of the qkv bias it was made from, fp32 copy)

        def forward(x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx) -> tuple:
            meta = ctx.attn_meta
            t = x.shape[0]
            if (not (self.enabled and self.dl.enabled and self.ad.enabled) or not meta.is_decode
                    or attn.qkv_proj is not qkv0 or attn.o_proj is not o0 or x.dtype != _BF16 or x.device.type != "cpu"
                    or x.dim() != 2 or not 0 < t <= min(MAX_ROWS, self.dl.max_tokens) or not x.is_contiguous() or not self.dl.pool.handle
                    or getattr(ctx.backend, "name", "") != "torch"
                    or (residual is not None and (residual.dtype != _BF16 or residual.shape != x.shape
                                                  or not residual.is_contiguous()))):
                return torch_forward(x, residual, positions, ctx)
            k_cache, v_cache = ctx.kv_caches[attn.layer_idx]
            if k_cache.dtype != _BF16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                return torch_forward(x, residual, positions, ctx)
            _, _, pos, slots, bt, lens = self._step_meta(meta, positions)
            key = (t, nq, nattn, hidden)
            scratch = self._scratch.get(key)
            if scratch is None:
                scratch = self._scratch[key] = tuple(torch.empty(t, n, dtype=_BF16)
                                                     for n in (hidden, hidden, nq, nattn, hidden))
            h1, res1, qkv, att, o = scratch
            h2, res2 = torch.empty(t, hidden, dtype=_BF16), torch.empty(t, hidden, dtype=_BF16)
            if residual is None:  # the first layer: its input norm as the layer's own forward does it
                h1 = n1(x)
                d.x, d.norm1_w, d.res2_in = h1.data_ptr(), None, x.data_ptr()
            else:
                d.x, d.res_in, d.norm1_w, d.res1 = x.data_ptr(), residual.data_ptr(), n1.weight.data_ptr(), res1.data_ptr()
                d.res2_in = res1.data_ptr()
            d.h1, d.norm2_w, d.res2, d.h2, d.T = h1.data_ptr(), n2.weight.data_ptr(), res2.data_ptr(), h2.data_ptr(), t
            wq, wo = qkv0.weight, o0.weight
            q = d.qkv
            q.w, q.ldw, q.x, q.ldx, q.out, q.T = wq.data_ptr(), wq.stride(0), h1.data_ptr(), hidden, qkv.data_ptr(), t
            b = qkv0.bias
            if b is not None:
                bkey = (b.data_ptr(), b._version)
                if bias32[0] != bkey:
                    bias32[0], bias32[1] = bkey, b.detach().float().contiguous()
                q.bias = bias32[1].data_ptr()
            cos, sin = self.ad._rope_tables(attn.rotary[0])
            a.qkv, a.cos, a.sin, a.positions, a.slots = qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), \
                pos.data_ptr(), slots.data_ptr()
            a.q_norm = attn.q_norm.weight.data_ptr() if attn.qk_norm else None
            a.k_norm = attn.k_norm.weight.data_ptr() if attn.qk_norm else None
            a.k_cache, a.v_cache, a.block_table, a.ld_bt = k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), \
                bt.stride(0)
            a.seq_lens, a.out, a.B, a.S = lens.data_ptr(), att.data_ptr(), t, k_cache.shape[1]
            ow = d.o
            ow.w, ow.ldw, ow.x, ow.ldx, ow.out, ow.T = wo.data_ptr(), wo.stride(0), att.data_ptr(), nattn, o.data_ptr(), t
            logits = None
            r = d.router
            if router is not None and router.weight.dtype == _BF16:
                wr = router.weight
                logits = torch.empty(t, wr.shape[0], dtype=_BF16)
                r.w, r.ldw, r.x, r.ldx, r.out, r.ldo, r.T = wr.data_ptr(), wr.stride(0), h2.data_ptr(), hidden, \
                    logits.data_ptr(), wr.shape[0], t
                r.N, r.K, r.out_dtype = wr.shape[0], wr.shape[1], 1
            else:
                r.N = 0
            self._run(d)
            self.native_calls += 1
            out = ffn.forward_logits(h2, logits) if logits is not None else ffn(h2)
            return out, res2

        return forward


def install_layer_decode(model: nn.Module, dl: DenseLinears | None, ad: AttnDecodeLayers | None
                         ) -> LayerDecodeLayers | None:
    """LayerDecodeLayers on `model` (needs both the dense linears and the native attention), or None."""
    if dl is None or ad is None:
        return None
    ld = LayerDecodeLayers(model, dl, ad)
    return ld if ld.layers else None
