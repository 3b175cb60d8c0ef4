"""Two Triton kernels that fold the hybrid layer's hand-over work into two launches (decode is
launch-bound), each next to its torch reference.

Legend: T tokens, H hidden, K top-k, E experts of the layer.

  split_stage: per token, the GPU-side ids/weights (pairs of CPU experts become expert 0 with weight
      0) into device tensors, and x, the CPU-side ids (-1 for GPU experts) and the weights straight
      into the pinned host buffers the CPU task reads (through their device-mapped addresses):
      replaces 2 gathers, 3 elementwise ops and 3 device-to-host copies.
  combine: out = bf16(gpu_out + host_out), reading the CPU result from pinned host memory: replaces
      a host-to-device copy, an add and two casts.

Writing and reading page-locked host memory from a kernel needs the GPU to map it (unified
addressing); `host_pointers_ok` checks once that the kernels run on such buffers, else the hybrid
layer keeps its unfused path.
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

log = logging.getLogger(__name__)


def split_stage_ref(x, ids, w, gpu_local, cpu_local, gid, gw, host_x, host_ids, host_w) -> None:
    """x [T, H]; ids [T, K]; w [T, K] f32; gpu_local/cpu_local [E] int32 (-1: other side);
    outputs gid [T, K] int32, gw [T, K] f32 (device), host_x [T, H], host_ids [T, K] int32,
    host_w [T, K] f32 (host)."""
    gl = gpu_local[ids.long()]
    on_gpu = gl >= 0
    gid.copy_(torch.where(on_gpu, gl, 0))
    gw.copy_(torch.where(on_gpu, w.float(), 0.0))
    host_x.copy_(x)
    host_ids.copy_(cpu_local[ids.long()])
    host_w.copy_(w)


def combine_ref(gpu_out: torch.Tensor | None, host_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = host_out.to(gpu_out.device if gpu_out is not None else host_out.device)
    if gpu_out is not None:
        out = gpu_out.float() + out
    return out.to(dtype)


if HAVE_TRITON:

    @triton.jit
    def _split_stage_kernel(x_ptr, ids_ptr, w_ptr, gl_ptr, cl_ptr, gid_ptr, gw_ptr, hx_ptr, hids_ptr, hw_ptr,
                            H, stride_x, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        ko = tl.arange(0, BLOCK_K)
        km = ko < K
        e = tl.load(ids_ptr + t * K + ko, mask=km, other=0)
        w = tl.load(w_ptr + t * K + ko, mask=km, other=0.0).to(tl.float32)
        gl = tl.load(gl_ptr + e, mask=km, other=-1)
        cl = tl.load(cl_ptr + e, mask=km, other=-1)
        on_gpu = gl >= 0
        tl.store(gid_ptr + t * K + ko, tl.where(on_gpu, gl, 0), mask=km)
        tl.store(gw_ptr + t * K + ko, tl.where(on_gpu, w, 0.0), mask=km)
        tl.store(hids_ptr + t * K + ko, cl, mask=km)
        tl.store(hw_ptr + t * K + ko, w, mask=km)
        for h0 in range(0, H, BLOCK_H):
            ho = h0 + tl.arange(0, BLOCK_H)
            hm = ho < H
            tl.store(hx_ptr + t * H + ho, tl.load(x_ptr + t * stride_x + ho, mask=hm), mask=hm)

    @triton.jit
    def _combine_kernel(gpu_ptr, host_ptr, out_ptr, H, HAS_GPU: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        ho = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = ho < H
        # .cv: the CPU wrote this memory since the last launch; never serve it from a cache
        acc = tl.load(host_ptr + t * H + ho, mask=hm, other=0.0, cache_modifier=".cv").to(tl.float32)
        if HAS_GPU:
            acc = tl.load(gpu_ptr + t * H + ho, mask=hm, other=0.0).to(tl.float32) + acc
        tl.store(out_ptr + t * H + ho, acc.to(out_ptr.dtype.element_ty), mask=hm)


def split_stage(x, ids, w, gpu_local, cpu_local, gid, gw, host_x, host_ids, host_w) -> None:
    """See split_stage_ref; one launch. x may have a row stride; every other tensor is contiguous."""
    t, h = x.shape
    if t == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    ids, w = ids.contiguous(), w.contiguous()  # no-ops for the router's outputs
    k = ids.shape[1]
    _split_stage_kernel[(t,)](x, ids, w, gpu_local, cpu_local, gid, gw, host_x, host_ids, host_w, h, x.stride(0),
                              K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_H=1024, num_warps=4)


def combine(gpu_out: torch.Tensor | None, host_out: torch.Tensor, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """[T, H] in `dtype` on `device` = gpu_out (+) host_out (f32, pinned host memory); one launch."""
    t, h = host_out.shape
    out = torch.empty(t, h, dtype=dtype, device=device)
    if t == 0:
        return out
    block = 1024
    _combine_kernel[(t, triton.cdiv(h, block))](gpu_out if gpu_out is not None else out, host_out, out, h,
                                                HAS_GPU=gpu_out is not None, BLOCK_H=block, num_warps=4)
    return out


_host_ok: dict[str, bool] = {}


def host_pointers_ok(device: torch.device) -> bool:
    """Whether both kernels run correctly on pinned host buffers here (checked once per device)."""
    key = str(device)
    if key in _host_ok:
        return _host_ok[key]
    ok = False
    if HAVE_TRITON and device.type == "cuda":
        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(3, 40, generator=g).to(device, torch.bfloat16)
            ids = torch.randint(0, 6, (3, 4), generator=g).to(device)
            w = torch.rand(3, 4, generator=g).to(device)
            mask = torch.tensor([True, False, True, False, False, True])
            gl = torch.where(mask, mask.cumsum(0) - 1, -1).to(device, torch.int32)
            cl = torch.where(~mask, (~mask).cumsum(0) - 1, -1).to(device, torch.int32)
            gid, gw = torch.empty(3, 4, dtype=torch.int32, device=device), torch.empty(3, 4, device=device)
            hx = torch.empty(3, 40, dtype=torch.bfloat16, pin_memory=True)
            hids = torch.empty(3, 4, dtype=torch.int32, pin_memory=True)
            hw = torch.empty(3, 4, pin_memory=True)
            split_stage(x, ids, w, gl, cl, gid, gw, hx, hids, hw)
            hout = torch.randn(3, 40, generator=g).pin_memory()
            gout = torch.randn(3, 40, generator=g).to(device, torch.bfloat16)
            out = combine(gout, hout, torch.bfloat16, device)
            torch.cuda.synchronize(device)
            ok = (torch.equal(hx, x.cpu()) and torch.equal(hids, cl.cpu()[ids.cpu()]) and torch.equal(hw, w.cpu())
                  and torch.equal(gid.cpu(), torch.where(gl[ids] >= 0, gl[ids], 0).cpu())
                  and torch.equal(out.cpu(), combine_ref(gout, hout, torch.bfloat16).cpu()))
        except Exception as e:  # e.g. Triton refusing a host pointer
            log.debug("fused hybrid kernels on host buffers: %s", e)
            ok = False
        if not ok:
            log.warning("hybrid layer: the fused hand-over kernels cannot use pinned host buffers here; "
                        "using copies instead (a few more launches per layer)")
    _host_ok[key] = ok
    return ok
