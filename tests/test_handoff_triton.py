"""The hybrid MoE hand-over kernels (hybridmoe/moe/handoff_triton.py) against the unfused path they replace.

CPU/CI: under the Triton interpreter in a subprocess (tests/interpreter.py).
- `handoff` per case: the pinned x, now-ids, deferred ids and fp32 weights, and the GPU experts' ids and
  weights, equal bit for bit to what hybrid.py's unfused path computes (split_deferred on the gathered
  CPU-local ids, the wheres of _gpu_part); rows past T untouched; the go word 1 and the ticket 0 after each
  launch (two launches through one ticket). Cases: odd H (one and several H tiles), strided x, K 1-8, all
  experts on one side, ties in the weights (the stable order), a NaN weight (sorted last, as torch does),
  bf16 router weights.
- `collect`: equal bit for bit to ((gpu + cpu) + cpu2).to(dtype) + side, with and without the deferred
  output and the shared term, in fp32, bf16 and fp16.
- End to end: a tiny Qwen3-MoE, hybrid (BF16 CPU method, 3 GPU experts of 10) on the emulated CUDA stream
  (tests/stream_emulation.py): the same prompt logits, bit for bit, and the same greedy tokens with the
  hand-over kernels as without, at deferral 0, 1 and 2 (merged and two-task forms).
GPU (`-m gpu`): the kernel cases on CUDA with pinned host buffers (the GPU's stores to host memory and the
release of the go word), and a hybrid layer's decode in a CUDA graph equal to the unfused path's.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from interpreter import case_result, collect, json_results

# name -> (T, H, K, E, defer, gpu experts: "some" | "none" | "all", x dtype, weight dtype, special)
CASES = {
    "t1_k8_d0": (1, 72, 8, 16, 0, "some", torch.float32, torch.float32, ""),
    "t1_k8_d2": (1, 2100, 8, 128, 2, "some", torch.bfloat16, torch.float32, ""),
    "t3_k6_d1_strided": (3, 300, 6, 40, 1, "some", torch.float16, torch.float32, "strided"),
    "t5_k4_d3_ties": (5, 96, 4, 10, 3, "some", torch.float32, torch.float32, "ties"),
    "t2_k8_d2_nan": (2, 64, 8, 32, 2, "some", torch.float32, torch.float32, "nan"),
    "t4_k2_d1_cpu_only": (4, 130, 2, 9, 1, "none", torch.bfloat16, torch.float32, ""),
    "t3_k3_d2_gpu_all": (3, 48, 3, 7, 2, "all", torch.float32, torch.float32, ""),
    "t1_k1_d0": (1, 1000, 1, 5, 0, "some", torch.bfloat16, torch.bfloat16, ""),
    "t17_k8_d2_bf16w": (17, 200, 8, 64, 2, "some", torch.bfloat16, torch.bfloat16, "ties"),
}
COLLECT = {  # name -> (T, H, dtype, with cpu2, with side, specials: NaN, infinities, signed zeros, subnormals)
    "c1_f32": (1, 72, torch.float32, False, False, False),
    "c3_bf16_side": (3, 2100, torch.bfloat16, True, True, False),
    "c2_f16_cpu2": (2, 300, torch.float16, True, False, True),
    "c5_bf16_side_only": (5, 1030, torch.bfloat16, False, True, False),
    "c2_bf16_specials": (2, 1030, torch.bfloat16, True, False, True),
}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN payloads aside."""
    nan = a.isnan()
    ia, ib = a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype])
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(ia[~nan], ib[~nan])


def _locals(e: int, gpu: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpu_local, gpu_local) [E] int32 for a random placement (hybrid.py _local_index)."""
    mask = torch.rand(e, generator=g) < 0.4
    if gpu == "none":
        mask[:] = False
    elif gpu == "all":
        mask[:] = True
    else:
        mask[0], mask[-1] = True, False

    def index(m: torch.Tensor) -> torch.Tensor:
        idx = torch.full((e,), -1, dtype=torch.int32)
        idx[m] = torch.arange(int(m.sum()), dtype=torch.int32)
        return idx

    return index(~mask), index(mask)


def _handoff_case(name: str, device: str = "cpu") -> dict:
    from hybridmoe.moe.handoff_triton import handoff, new_ticket
    from hybridmoe.moe.hybrid import split_deferred

    T, H, K, E, defer, gpu, xdt, wdt, special = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    pin = device != "cpu"
    dev = torch.device(device)
    xs = torch.randn(T, H + (5 if special == "strided" else 0), generator=g).to(xdt)
    x = xs[:, :H]
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    if special == "ties":
        w = (w * 3).floor() / 4  # few distinct values: the stable order decides
    if special == "nan":
        w[0, 1] = float("nan")
    w = w.to(wdt)
    cpu_local, gpu_local = _locals(E, gpu, g)
    cap = T + 3
    x_h = torch.full((cap, H), 7, dtype=xdt, pin_memory=pin)
    ids_h = torch.full((cap, K), 99, dtype=torch.int32, pin_memory=pin)
    ids2_h = torch.full((cap, K), 99, dtype=torch.int32, pin_memory=pin)
    w_h = torch.full((cap, K), 5.0, dtype=torch.float32, pin_memory=pin)
    go = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
    ticket = new_ticket(dev)
    has_gpu = bool((gpu_local >= 0).any())
    res: dict = {}
    for launch in range(2):  # the second launch needs the first to have reset the ticket
        go.zero_()
        got = handoff(xs.to(dev)[:, :H], ids.to(dev), w.to(dev), cpu_local.to(dev),
                      gpu_local.to(dev) if has_gpu else None, defer, x_h, ids_h, ids2_h if defer else None, w_h, go,
                      ticket)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res[f"go_{launch}"] = int(go.item()) == 1
        res[f"ticket_{launch}"] = int(ticket.item()) == 0
    now, later = split_deferred(cpu_local[ids.long()], w, defer)
    res["x"] = torch.equal(x_h[:T], x) and bool((x_h[T:] == 7).all())
    res["ids_now"] = torch.equal(ids_h[:T], now.int()) and bool((ids_h[T:] == 99).all())
    res["ids_later"] = torch.equal(ids2_h[:T], later.int()) if defer else bool((ids2_h == 99).all())
    res["w"] = torch.equal(w_h[:T], w.float()) or torch.equal(w_h[:T].isnan(), w.float().isnan()) and torch.equal(
        w_h[:T].nan_to_num(), w.float().nan_to_num())
    res["w"] = res["w"] and bool((w_h[T:] == 5).all())
    if has_gpu:
        gl = gpu_local[ids.long()]
        valid = gl >= 0
        gid, gw = got[0].cpu(), got[1].cpu()
        res["gpu_ids"] = torch.equal(gid, torch.where(valid, gl, 0)) and gid.dtype == torch.int32
        ref_gw = torch.where(valid, w, 0.0)
        res["gpu_w"] = gw.dtype == w.dtype and torch.equal(gw.isnan(), ref_gw.isnan()) and torch.equal(
            gw.nan_to_num(), ref_gw.nan_to_num())
    else:
        res["gpu_none"] = got is None
    res["deferred_pairs"] = int((later >= 0).sum()) if later is not None else 0
    res["ok"] = all(v for k, v in res.items() if k != "deferred_pairs")
    return res


def _collect_case(name: str, device: str = "cpu") -> dict:
    from hybridmoe.moe.handoff_triton import collect as collect_out

    T, H, dt, with2, with_side, specials = COLLECT[name]
    g = torch.Generator().manual_seed(len(name) + 100)
    pin = device != "cpu"
    gpu = torch.randn(T, H, generator=g)
    if specials:  # magnitudes across the whole range (bf16 overflow to inf, subnormals, round to +-0), specials
        gpu *= torch.logspace(-44, 38.5, H)
        gpu[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, -1e-41])
    gpu = gpu.to(device)
    cpu = torch.randn(T + 2, H, generator=g).pin_memory() if pin else torch.randn(T + 2, H, generator=g)
    if specials:
        cpu[:, :H // 2] = -0.0  # -0 + -0 stays -0; subnormal sums
    cpu2 = (torch.randn(T + 2, H, generator=g).pin_memory() if pin else torch.randn(T + 2, H, generator=g)) \
        if with2 else None
    side = torch.randn(T, H + 3, generator=g).to(device, dt)[:, :H] if with_side else None
    out = collect_out(gpu, cpu, cpu2, side, dt)
    ref = gpu.clone()
    ref += cpu[:T].to(device)
    if cpu2 is not None:
        ref += cpu2[:T].to(device)
    ref = ref.to(dt)
    if side is not None:
        ref = ref + side
    return {"ok": _same_bits(out, ref), "max_diff": (out.float() - ref.float()).abs().nan_to_num().max().item()}


def _e2e_case(deferred: int, merge: bool) -> dict:
    """The emulated stream path with and without the hand-over kernels: bit-equal logits, the same tokens."""
    import tempfile
    from pathlib import Path

    from _pytest.monkeypatch import MonkeyPatch
    from stream_emulation import emulate_stream

    from hybridmoe import LLM

    from tiny_models import hf_model, make_tiny_model

    d = Path(tempfile.mkdtemp())
    hf_model(make_tiny_model("qwen3_moe", d / "f32")).to(torch.bfloat16).save_pretrained(str(d / "bf16"))
    prompt = torch.randint(0, 211, (37,), generator=torch.Generator().manual_seed(6)).tolist()
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    mp = MonkeyPatch()
    out = {}
    try:
        emulate_stream(mp)
        llm = LLM(str(d / "bf16"), device="cpu", progress=False, kt_method="BF16", kt_num_gpu_experts=3,
                  kt_max_deferred_experts_per_token=deferred, hybrid_stream_wait="memop")
        rt = llm.engine.runner.hybrid
        rt.set_merge_deferred(merge)
        calls = {"n": 0}
        from hybridmoe.moe import handoff_triton

        orig = handoff_triton.handoff

        def counted(*a, **kw):
            calls["n"] += 1
            return orig(*a, **kw)

        mp.setattr(handoff_triton, "handoff", counted)
        for fused in (False, True):
            rt.set_fused_handoff(fused)
            logits = llm.prompt_logits(prompt)
            toks = [o["output_ids"] for o in llm.generate(input_ids=[prompt, prompt[:11]], sampling_params=greedy)]
            alone = llm.generate(input_ids=prompt[:23], sampling_params=greedy)["output_ids"]
            out[fused] = (logits, toks, alone)
        llm.shutdown()
    finally:
        mp.undo()
    (l0, t0, a0), (l1, t1, a1) = out[False], out[True]
    res = {"logits_equal": torch.equal(l0, l1), "tokens_equal": t0 == t1 and a0 == a1, "handoffs": calls["n"]}
    res["ok"] = res["logits_equal"] and res["tokens_equal"] and calls["n"] > 0
    return res


E2E = {"e2e_d0": (0, True), "e2e_d1_two_tasks": (1, False), "e2e_d2_merged": (2, True)}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return json_results(__file__)


@pytest.mark.parametrize("name", [*CASES, *COLLECT, *E2E])
def test_interpreter(interp_results: dict, name: str) -> None:
    res = case_result(interp_results, name)
    assert res["ok"], res


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", [*CASES, *COLLECT])
def test_gpu(name: str) -> None:
    res = _handoff_case(name, "cuda") if name in CASES else _collect_case(name, "cuda")
    assert res["ok"], res


if __name__ == "__main__" and "--interp" in sys.argv:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cases = {n: (lambda n=n: _handoff_case(n)) for n in CASES}
    cases.update({n: (lambda n=n: _collect_case(n)) for n in COLLECT})
    cases.update({n: (lambda a=a: _e2e_case(*a)) for n, a in E2E.items()})
    print(json.dumps(collect(cases)))
