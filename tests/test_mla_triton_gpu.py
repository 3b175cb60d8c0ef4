"""GPU tests of the MLA decode kernel (hybridmoe/layers/attention/mla_triton.py): the cases of
tests/test_mla_triton.py compiled, DeepSeek-V3 sizes (H 128, Lkv 512, R 64) in bf16 at contexts 1 to
32768 and page sizes 1/16/64, several tiles, no host sync, and a CUDA-graph capture and replay.
Tolerances: test_mla_triton.py's docstring.
"""

from __future__ import annotations

import pytest
import torch

from test_mla_triton import CASES, DTYPES, TOL, make_case, needs_cuda, rel_err, run_case, run_empty_sequence

# ---- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_mla_decode_gpu_small(case: tuple, dt: str) -> None:
    """The interpreter cases compiled for the GPU, in every dtype."""
    err = run_case(case, DTYPES[dt], "cuda")
    assert err <= TOL[DTYPES[dt]], f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_mla_decode_gpu_empty_sequence() -> None:
    """A length-0 slot gives zeros, split or not, compiled."""
    assert run_empty_sequence("cuda") == []


def _deepseek_check(lens: list[int], page: int, dtype=torch.bfloat16, seed: int = 0, **kw) -> float:
    """The kernel at DeepSeek-V3 sizes against mla_decode_ref computed in fp32 from the same rounded inputs."""
    from hybridmoe.layers.attention.mla_triton import mla_decode, mla_decode_ref

    x = make_case(lens, 128, 512, 64, page, dtype, "cuda", seed)
    x["scale"] = (128 + 64) ** -0.5  # DeepSeek's qk_head_dim ** -0.5 (before YaRN's mscale)
    out = mla_decode(**x, **kw)
    assert out.dtype == dtype
    ref = mla_decode_ref(**{k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                            for k, v in x.items()})
    return rel_err(out, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 1000, 8192, 32768])
def test_mla_decode_gpu_deepseek(ctx: int, page: int) -> None:
    """bf16, H 128 / Lkv 512 / R 64, shuffled pages: a sequence of `ctx` tokens beside two shorter ones."""
    err = _deepseek_check([ctx, max(1, ctx // 3), min(ctx, 17)], page)
    assert err <= TOL[torch.bfloat16], f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_mla_decode_gpu_batch64() -> None:
    """64 sequences of random lengths up to 8192 (auto splits at a large batch), bf16 and fp16."""
    lens = torch.randint(1, 8193, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    for dtype in (torch.bfloat16, torch.float16):
        err = _deepseek_check(lens, 16, dtype)
        assert err <= TOL[dtype], f"{dtype}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [(16, 32, 4, 2), (32, 32, 4, 2), (32, 64, 8, 2), (64, 16, 8, 3), (64, 32, 8, 1),
                                 (64, 64, 8, 2)], ids=str)
@pytest.mark.parametrize("splits", [1, 5, None])
def test_mla_decode_gpu_configs(cfg: tuple, splits: int | None) -> None:
    """The tiles the benchmark's --sweep tries are correct too (when they fit the GPU)."""
    from triton.runtime.errors import OutOfResources

    from hybridmoe.layers.attention.mla_triton import MLADecodeConfig

    try:
        err = _deepseek_check([3000, 1, 700], 16, config=MLADecodeConfig(*cfg), num_splits=splits)
    except OutOfResources as e:  # a tile too large for this GPU's shared memory
        pytest.skip(f"does not fit: {e}")
    assert err <= TOL[torch.bfloat16], f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_mla_decode_no_host_sync() -> None:
    """No call synchronizes with the host (after the first, which compiles)."""
    from hybridmoe.layers.attention.mla_triton import mla_decode

    x = make_case([900, 5, 33], 128, 512, 64, 16, torch.bfloat16, "cuda")
    mla_decode(**x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode(**x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page", [1, 16])
def test_mla_decode_cuda_graph(page: int) -> None:
    """Captured once, replayed with other seq_lens and block tables: the eager result, bit for bit."""
    from hybridmoe.layers.attention.mla_triton import mla_decode, mla_decode_ref

    bsz, ctx = 4, 2048
    pages = ctx // page
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(1 + bsz * pages, page, 576, generator=g).bfloat16().cuda()
    q_lat = torch.empty(bsz, 128, 512, dtype=torch.bfloat16, device="cuda")
    q_rope = torch.empty(bsz, 128, 64, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(bsz, pages, dtype=torch.int32, device="cuda")
    lens = torch.ones(bsz, dtype=torch.int32, device="cuda")
    scale = 192**-0.5

    def fill(seed: int, new_lens: list[int]) -> None:
        gg = torch.Generator().manual_seed(seed)
        q_lat.copy_(torch.randn(bsz, 128, 512, generator=gg))
        q_rope.copy_(torch.randn(bsz, 128, 64, generator=gg))
        perm = 1 + torch.randperm(bsz * pages, generator=gg)
        table.zero_()
        for b, n in enumerate(new_lens):
            used = -(-n // page)
            table[b, :used] = perm[b * pages : b * pages + used].to(torch.int32).cuda()
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))

    fill(0, [ctx, 1, 100, 1500])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mla_decode(q_lat, q_rope, kv, table, lens, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q_lat, q_rope, kv, table, lens, scale)
    for seed, new_lens in ((1, [17, ctx, 1, 16]), (2, [1, 1, 1, 1]), (3, [1000, 2047, 64, 65])):
        fill(seed, new_lens)
        graph.replay()
        torch.cuda.synchronize()
        eager = mla_decode(q_lat, q_rope, kv, table, lens, scale)
        assert torch.equal(out, eager), f"seed {seed}: replay differs from eager"
        ref = mla_decode_ref(q_lat.float(), q_rope.float(), kv.float(), table, lens, scale)
        assert rel_err(out, ref) <= TOL[torch.bfloat16]
