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


@pytest.mark.parametrize("count", ["no", "all", "valid"])
@pytest.mark.parametrize("renorm", [True, False])
def test_router_topk_kernel_compiles(renorm, count):
    """The fused router's scalar ticket atomic, its float bits through int32 atomics and the last program's
    branch, with the expert count (int64 atomics, the padding-row test) or without (moe/router_triton.py)."""
    from hybridmoe.moe.router_triton import _router_topk_kernel

    types = dict(x_ptr="*bf16", w_ptr="*bf16", logits_ptr="*i32", ticket_ptr="*i32", wout_ptr="*fp32",
                 ids_ptr="*i32", counts_ptr="*i64", valid_ptr="*i64", H="i32", E="i32")
    compile_sm90(_router_topk_kernel, types, dict(K=8, RENORM=renorm, EP=2, BLOCK_H=1024, BLOCK_E=128,
                                                  COUNT=count != "no", HAS_VALID=count == "valid", BLOCK_K=8))


def test_count_kernel_compiles():
    """The expert-distribution count: int64 atomic adds under a row mask (moe/recorder_kernel.py)."""
    from hybridmoe.moe.recorder_kernel import _count_kernel

    types = dict(ids_ptr="*i32", counts_ptr="*i64", valid_ptr="*i64", num_pairs="i32", top_k="i32", num_experts="i32")
    compile_sm90(_count_kernel, types, dict(HAS_VALID=True, BLOCK=1024))


@pytest.mark.parametrize("direct", [True, False])
def test_moe_kernels_compile_direct(direct):
    """The fused MoE's gate/up and down kernels with and without the one-token form (DIRECT)."""
    from hybridmoe.moe import triton_moe_kernels as K

    common = dict(num_pairs="i32", num_experts="i32", num_m_blocks="i32", H="i32", I_SIZE="i32", stride_we="i32",
                  stride_wn="i32", s_ptr="*bf16", stride_se="i32", stride_sn="i32", stride_sk="i32")
    gu = dict(common, x_ptr="*bf16", w_ptr="*bf16", inter_ptr="*bf16", sorted_pairs_ptr="*i32",
              block_expert_ptr="*i32", weights_ptr="*fp32", top_k="i32", stride_xt="i32", stride_xh="i32",
              stride_wh="i32", stride_ip="i32", stride_ii="i32", up_scale_row="i32", delta_ptr="*fp32",
              stride_dp="i32")
    compile_sm90(K._gate_up_kernel, gu, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, IEEE=False, FP8=False,
                                             SBN=1, SBK=1, DELTA=False, DIRECT=direct))
    dn = dict(common, inter_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", weights_ptr="*fp32", sorted_pairs_ptr="*i32",
              block_expert_ptr="*i32", stride_ip="i32", stride_ii="i32", stride_wk="i32", stride_op="i32",
              stride_oh="i32")
    compile_sm90(K._down_kernel, dn, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, IEEE=False, FP8=False,
                                          SBN=1, SBK=1, DIRECT=direct))
