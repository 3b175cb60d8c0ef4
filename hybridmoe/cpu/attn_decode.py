"""Decode attention of the CPU-only model path in one native call per layer (csrc/attn_decode.h):
q/k RMSNorm + RoPE of the fused qkv row, the KV-cache store and the attention over each
sequence's pages, instead of ~30 small torch ops (whose per-op cost, not bytes, was most of a
decode layer's attention time on the 2-core machine).

    ad = install_attn_decode(model)   # on every standard-attention layer; None when none qualifies
    ad.enabled = False                # back to the torch path (benchmarks, tests)

The same switch covers the decoder's RMSNorms (RMSNorm.add_norm, and forward) for decode-sized bf16
inputs: one native call instead of ~9 torch ops each, with the reference's roundings.

Used only for decode batches with bf16 activations and a bf16 cache on the torch attention
backend; everything else (prefill, other dtypes, MLA) runs the layer's own forward, which is also
the reference the tests compare against.
"""

from __future__ import annotations

import ctypes as C

import torch
from torch import nn

from hybridmoe.cpu import native
from hybridmoe.layers.attention.layer import Attention, ForwardContext
from hybridmoe.layers.norm import RMSNorm

MAX_NORM_ROWS = 4  # add_norm natively up to this many rows (decode); more: torch's ops


class AttnDecode(C.Structure):
    """HmAttnDecode (csrc/attn_decode.h)."""

    _fields_ = [(n, C.c_void_p) for n in ("qkv", "q_norm", "k_norm", "cos", "sin", "positions", "k_cache", "v_cache",
                                         "slots", "block_table", "seq_lens", "out")] + \
        [(n, C.c_int64) for n in ("ld_qkv", "ld_bt", "ld_out")] + \
        [(n, C.c_int32) for n in ("B", "Hq", "Hkv", "D", "S", "pad_")] + [("eps", C.c_float), ("scale", C.c_float)]


_declared = None


def _lib():
    global _declared
    lb = native.lib()
    if _declared is not lb:
        lb.hm_attn_decode.restype = C.c_int
        lb.hm_attn_decode.argtypes = [C.POINTER(AttnDecode), C.c_char_p, C.c_int]
        lb.hm_attn_decode_pool.restype = C.c_int
        lb.hm_attn_decode_pool.argtypes = [C.c_void_p, C.POINTER(AttnDecode), C.c_char_p, C.c_int]
        lb.hm_attn_kernel.restype = C.c_int
        lb.hm_attn_kernel.argtypes = [C.c_int]
        lb.hm_add_rmsnorm_bf16.restype = C.c_int
        lb.hm_add_rmsnorm_bf16.argtypes = [C.c_void_p, C.c_void_p, C.c_void_p, C.c_int64, C.c_int64, C.c_float,
                                           C.c_void_p, C.c_void_p]
        _declared = lb
    return lb


KERNELS = ("auto", "avx2", "avx512")


def set_kernel(name: str) -> str:
    """The span kernel of every later native decode attention call in this process (csrc/attn_pool.cpp
    hm_attn_kernel): "auto" (AVX-512 where the CPU has F, BW, VL, VNNI and BF16, else AVX2), "avx2" or
    "avx512". For benchmarks and tests; returns the previous setting."""
    if name not in KERNELS:
        raise ValueError(f"unknown decode attention kernel {name!r}; choose one of {list(KERNELS)}")
    prev = _lib().hm_attn_kernel(KERNELS.index(name))
    if prev < 0:
        raise ValueError(f"decode attention kernel {name!r} cannot run here: {native.isa_missing('avx512')}")
    return KERNELS[prev]


def kernel_available(name: str) -> bool:
    """Whether set_kernel(name) would succeed here."""
    if name not in KERNELS:
        raise ValueError(f"unknown decode attention kernel {name!r}; choose one of {list(KERNELS)}")
    if name != "avx512":
        return True
    prev = _lib().hm_attn_kernel(2)
    if prev < 0:
        return False
    _lib().hm_attn_kernel(prev)
    return True


def _i(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


class AttnDecodeLayers:
    """Native decode forwards installed on a model's standard attention layers."""

    def __init__(self, model: nn.Module) -> None:
        self.enabled = True
        self.native_calls = 0  # decode steps run natively (tests check the path was taken)
        self.pool = None  # a CPUThreadPool whose threads share the work (when idle); None: the calling thread
        self.modules: dict[str, Attention] = {}
        self.norms: dict[str, RMSNorm] = {}
        self._tables: dict[int, tuple] = {}  # id(rotary) -> (key, cos fp32, sin fp32)
        for name, mod in model.named_modules():
            if isinstance(mod, Attention) and mod.head_dim % 2 == 0 and mod.head_dim <= 1024:
                self.modules[name] = mod
                mod.forward = self._make_forward(mod)
            elif isinstance(mod, RMSNorm):
                self.norms[name] = mod
                mod.add_norm = self._make_add_norm(mod)
                mod.forward = self._make_norm(mod)

    def remove(self) -> None:
        for mod in self.modules.values():
            del mod.forward
        for mod in self.norms.values():
            del mod.add_norm
            del mod.forward
        self.modules, self.norms = {}, {}

    def _make_add_norm(self, mod: RMSNorm):
        torch_add_norm = mod.add_norm
        lb = _lib()

        def add_norm(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w = mod.weight
            if (not self.enabled or x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16
                    or w.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or residual.shape != x.shape
                    or not 0 < x.shape[0] <= MAX_NORM_ROWS or not (x.is_contiguous() and residual.is_contiguous())
                    or x.shape[1] != w.shape[0] or not w.is_contiguous()):
                return torch_add_norm(x, residual)
            out, res = torch.empty_like(x), torch.empty_like(x)
            if lb.hm_add_rmsnorm_bf16(x.data_ptr(), residual.data_ptr(), w.data_ptr(), x.shape[0], x.shape[1], mod.eps,
                                      out.data_ptr(), res.data_ptr()):
                return torch_add_norm(x, residual)
            self.native_calls += 1
            return out, res

        return add_norm

    def _make_norm(self, mod: RMSNorm):
        """RMSNorm.forward (no residual: the first layer's input norm) natively, as add_norm."""
        torch_forward = mod.forward
        lb = _lib()

        def forward(x: torch.Tensor) -> torch.Tensor:
            w = mod.weight
            if (not self.enabled or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu"
                    or x.dim() != 2 or not 0 < x.shape[0] <= MAX_NORM_ROWS or not x.is_contiguous()
                    or x.shape[1] != w.shape[0] or not w.is_contiguous()):
                return torch_forward(x)
            out = torch.empty_like(x)
            if lb.hm_add_rmsnorm_bf16(x.data_ptr(), None, w.data_ptr(), x.shape[0], x.shape[1], mod.eps, out.data_ptr(),
                                      None):
                return torch_forward(x)
            self.native_calls += 1
            return out

        return forward

    def _rope_tables(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rope.cos.data_ptr(), rope.cos.dtype, rope.cos.shape)
        hit = self._tables.get(id(rope))
        if hit is None or hit[0] != key:
            hit = (key, rope.cos.float().contiguous(), rope.sin.float().contiguous())
            self._tables[id(rope)] = hit
        return hit[1], hit[2]

    def _make_forward(self, mod: Attention):
        torch_forward = mod.forward
        err = C.create_string_buffer(512)
        lb = _lib()

        def forward(x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
            meta = ctx.attn_meta
            k_cache, v_cache = ctx.kv_caches[mod.layer_idx]
            if (not self.enabled or not meta.is_decode or x.dtype != torch.bfloat16 or x.device.type != "cpu"
                    or k_cache.dtype != torch.bfloat16 or getattr(ctx.backend, "name", "") != "torch"
                    or (mod.qk_norm and mod.q_norm.weight.dtype != torch.bfloat16)
                    or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
                return torch_forward(x, positions, ctx)
            qkv = mod.qkv_proj(x)
            if qkv.stride(-1) != 1:
                qkv = qkv.contiguous()
            b = qkv.shape[0]
            out = torch.empty(b, mod.num_heads * mod.head_dim, dtype=torch.bfloat16)
            cos, sin = self._rope_tables(mod.rotary[0])
            pos, slots = _i(positions, torch.int64), _i(meta.slot_mapping, torch.int64)
            bt, lens = meta.block_table, _i(meta.seq_lens, torch.int32)
            if bt.dtype != torch.int32 or bt.stride(-1) != 1:
                bt = bt.to(torch.int32).contiguous()
            qn = mod.q_norm.weight.data_ptr() if mod.qk_norm else None
            kn = mod.k_norm.weight.data_ptr() if mod.qk_norm else None
            a = AttnDecode(qkv.data_ptr(), qn, kn, cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), k_cache.data_ptr(),
                           v_cache.data_ptr(), slots.data_ptr(), bt.data_ptr(), lens.data_ptr(), out.data_ptr(),
                           qkv.stride(0), bt.stride(0), out.stride(0), b, mod.num_heads, mod.num_kv_heads,
                           mod.head_dim, k_cache.shape[1], 0, mod.rms_eps, mod.scale)
            self.native_calls += 1
            pool = self.pool.handle if self.pool is not None else None
            if lb.hm_attn_decode_pool(pool, C.byref(a), err, len(err)):
                raise RuntimeError(err.value.decode())
            return mod.o_proj(out)

        return forward


def install_attn_decode(model: nn.Module) -> AttnDecodeLayers | None:
    """AttnDecodeLayers on `model`, or None when it has no standard attention layer or the kernel
    cannot run here (no AVX2)."""
    if native.isa_missing("avx2"):
        return None
    ad = AttnDecodeLayers(model)
    return ad if ad.modules else None
