"""LoRA decode cost: a full-size MoE model with random weights (default: Qwen3-30B-A3B shape, 32 GPU
experts, AMXINT8), once without LoRA and once serving rank-R adapters on attention (q/k/v/o_proj) and
on every routed expert (both the GPU and the CPU share), both alive in one process and timed
interleaved (--repeat, medians): batch 1 base against batch 1 on an adapter, batch B base against B
requests on B different adapters. Issue 17's targets: 0.9 and 0.8 of the base tok/s.

One adapter directory is written (PEFT layout, per-expert keys as convert-lora writes them) and
loaded under B names: each name takes its own slot, which is what the step pays for.

    python benchmarks/bench_lora_decode.py --out lora_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, parse_shape_args, write_config  # noqa: E402


def write_adapter(d: Path, a: argparse.Namespace, rank: int) -> Path:
    """Random rank-`rank` LoRA on q/k/v/o_proj of every layer and on every expert of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {}

    def pair(prefix: str, n_in: int, n_out: int) -> None:
        t[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in**0.5).bfloat16()
        t[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).bfloat16()

    h, i, qd, kd = a.hidden, a.inter, a.heads * a.head_dim, a.kv_heads * a.head_dim
    for layer in range(a.layers):
        p = f"base_model.model.model.layers.{layer}"
        for name, n_in, n_out in (("q_proj", h, qd), ("k_proj", h, kd), ("v_proj", h, kd), ("o_proj", qd, h)):
            pair(f"{p}.self_attn.{name}", n_in, n_out)
        for e in range(a.experts):
            pair(f"{p}.mlp.experts.{e}.gate_proj", h, i)
            pair(f"{p}.mlp.experts.{e}.up_proj", h, i)
            pair(f"{p}.mlp.experts.{e}.down_proj", i, h)
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "task_type": "CAUSAL_LM",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "base_model_name_or_path": "random"}))
    return d


def timed_decode(llm, loras: list[str | None], prompt_len: int, steps: int, vocab: int) -> float:
    """tok/s of `len(loras)` requests decoding together (prefill and the first step not timed)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(len(loras))
    reqs = [eng.make_request(input_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                             sampling_params={"max_new_tokens": steps + 2, "temperature": 0, "ignore_eos": True},
                             lora_path=name) for name in loras]
    for r in reqs:
        eng.submit(r)
    while any(len(r.output_ids) < 2 for r in reqs):
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while not all(r.finished for r in reqs):
        n += len(eng.step())
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--gpu-experts", type=int, default=32)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="the multi-adapter batch: this many adapters")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tests), not a measurement")
    p.add_argument("--out", default=None)
    a = parse_shape_args(p)

    from hybridmoe import LLM

    cuda = a.device == "cuda"
    results: dict = {"shape": vars(a), "runs": []}
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        t = time.perf_counter()
        adapter = write_adapter(Path(d) / "adapter", a, a.rank)
        print(f"adapter written in {time.perf_counter() - t:.1f} s", flush=True)
        common = dict(device=a.device, dtype="bfloat16" if cuda else "float32", load_format="dummy", progress=False,
                      skip_tokenizer_init=True, kt_method=a.method, kt_num_gpu_experts=a.gpu_experts,
                      cuda_graph_max_bs=max(a.batch, 1), max_running_requests=a.batch,
                      max_total_tokens=a.batch * (a.prompt_len + a.steps + 64), context_length=1024)
        t = time.perf_counter()
        base = LLM(d, **common)
        names = [f"a{k}" for k in range(a.batch)]
        lora = LLM(d, **common, lora_paths=[f"{n}={adapter}" for n in names], max_loras_per_batch=a.batch,
                   max_lora_rank=a.rank)
        print(f"models ready in {time.perf_counter() - t:.1f} s", flush=True)
        from hybridmoe.lora.engine_ops import loaded

        results["adapters"] = sorted(loaded(lora.engine))
        settings = [("base", 1, base, [None]), ("lora", 1, lora, names[:1]),
                    ("base", a.batch, base, [None] * a.batch), ("lora", a.batch, lora, names)]
        for rep in range(a.repeat):
            for kind, b, llm, loras in settings:
                tps = timed_decode(llm, loras, a.prompt_len, a.steps, a.vocab)
                results["runs"].append({"rep": rep, "kind": kind, "batch": b, "tokens_per_s": tps})
                print(f"rep {rep} {kind:4s} batch {b}: {tps:8.1f} tok/s", flush=True)
                if a.out:
                    Path(a.out).write_text(json.dumps(results, indent=2))
        lora.shutdown()
        base.shutdown()
    med = {(k, b): statistics.median(r["tokens_per_s"] for r in results["runs"] if (r["kind"], r["batch"]) == (k, b))
           for k, b, _, _ in settings}
    results["summary"] = []
    for b, target in ((1, 0.9), (a.batch, 0.8)):
        ratio = med[("lora", b)] / med[("base", b)]
        results["summary"].append({"batch": b, "base": med[("base", b)], "lora": med[("lora", b)], "ratio": ratio,
                                   "target": target})
        print(f"batch {b}: base {med[('base', b)]:.1f} tok/s, LoRA ({'1 adapter' if b == 1 else f'{b} adapters'}) "
              f"{med[('lora', b)]:.1f} tok/s: ratio {ratio:.3f} (target {target})", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
