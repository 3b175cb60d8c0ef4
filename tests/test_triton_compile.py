"""The hand-written Triton kernels compile for an H100/H200 target (sm_90) on a machine without a
GPU. The interpreter tests run the kernels' Python semantics; this catches what only the compiler
rejects (a variable given different types in the two branches of a run-time `if`, for example),
which otherwise shows up first on the GPU machine."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybridmoe.layers import fused_ops as F  # noqa: E402


def compile_sm90(kernel, types: dict[str, str], constexprs: dict[str, object]) -> None:
    sig = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))


QKV_TYPES = dict(qkv_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64",
                 slot_ptr="*i64", q_out_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16", stride_t="i32",
                 num_heads="i32", num_kv_heads="i32", half="i32", eps="fp32")


@pytest.mark.parametrize("has_norm", [True, False])
def test_qkv_rope_store_kernel_compiles(has_norm):
    compile_sm90(F._qkv_rope_store_kernel, QKV_TYPES, dict(HAS_NORM=has_norm, BLOCK=64))


@pytest.mark.parametrize("has_norm", [True, False])
def test_qk_norm_rope_kernel_compiles(has_norm):
    types = dict(x_ptr="*bf16", w_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", out_ptr="*bf16",
                 num_heads="i32", half="i32", eps="fp32")
    compile_sm90(F._qk_norm_rope_kernel, types, dict(HAS_NORM=has_norm, BLOCK=64))


@pytest.mark.parametrize("has_res", [True, False])
def test_add_rmsnorm_kernel_compiles(has_res):
    types = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", n="i32",
                 eps="fp32")
    compile_sm90(F._add_rmsnorm_kernel, types, dict(HAS_RES=has_res, BLOCK=2048))


def test_topk_softmax_kernel_compiles():
    types = dict(logits_ptr="*bf16", w_ptr="*fp32", ids_ptr="*i32", n_experts="i32")
    compile_sm90(F._topk_softmax_kernel, types, dict(K=8, RENORM=True, BLOCK=128))


def test_sum_pairs_kernel_compiles():
    from hybridmoe.moe.triton_moe_kernels import _sum_pairs_kernel

    compile_sm90(_sum_pairs_kernel, dict(pairs_ptr="*bf16", out_ptr="*bf16", H="i32"), dict(K=8, BLOCK=1024))
