"""All-GPU decode with the decode-path kernel choices switched in one process, interleaved: the fused MoE's
one-token form without the expert grouping (HYBRIDMOE_MOE_DIRECT) and the one-launch router GEMV + top-k
(HYBRIDMOE_ROUTER_FUSED); VARIANTS is the place for the next such switch. One model (random weights, Qwen3-30B-A3B shape by default); per round and variant the
decode CUDA graphs are recaptured with the variables set, then batch 1 and 4 decode (tok/s). Prints the median of
the rounds per variant and batch, the batch-1 ratio to the weight-read bound (the copy rate of the same run), and
whether each variant's greedy tokens equal the first variant's (bf16 rounding differs between kernels, so a
random-weight model may part at a near-tie: reported, not asserted).

    python benchmarks/ab_decode_kernels.py --rounds 3 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, bytes_per_token, copy_bandwidth, parse_shape_args, start_decode, write_config  # noqa: E402

VARIANTS = {  # name -> environment
    "base": {"HYBRIDMOE_MOE_DIRECT": "0", "HYBRIDMOE_ROUTER_FUSED": "0"},
    "direct": {"HYBRIDMOE_MOE_DIRECT": "1", "HYBRIDMOE_ROUTER_FUSED": "0"},
    "direct+router": {"HYBRIDMOE_MOE_DIRECT": "1", "HYBRIDMOE_ROUTER_FUSED": "1"},
}


def run_decode(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> tuple[float, list[list[int]]]:
    """(tok/s of the decode steps, each request's output tokens)."""
    reqs = start_decode(llm, batch, prompt_len, steps, vocab)
    t0, n = time.perf_counter(), 0
    while not all(r.finished for r in reqs):
        n += len(llm.engine.step())
    return n / (time.perf_counter() - t0), [list(r.output_ids) for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    a = parse_shape_args(p)
    names = a.variants.split(",")

    from hybridmoe import LLM

    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        max_bs = max(a.batch)
        llm = LLM(d, device="cuda", dtype="bfloat16", load_format="dummy", progress=False, skip_tokenizer_init=True,
                  cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                  max_total_tokens=max_bs * (a.prompt_len + a.steps + 64), context_length=4096)
        bound = bw / bytes_per_token(llm.engine.runner.model, a.topk)
        first_tokens: dict[int, list] = {}
        for r in range(a.rounds):
            for name in names:
                os.environ.update(VARIANTS[name])
                llm.engine.runner.capture_graphs()
                for b in a.batch:
                    tps, toks = run_decode(llm, b, a.prompt_len, a.steps, a.vocab)
                    same = first_tokens.setdefault(b, toks) == toks
                    rows.append({"round": r, "variant": name, "batch": b, "tokens_per_s": tps, "same_tokens": same})
                    print(f"round {r} {name:14s} batch {b}: {tps:8.1f} tok/s  tokens same as first: {same}",
                          flush=True)
    print(f"medians ({a.rounds} rounds; batch-1 bound {bound:.0f} tok/s):")
    summary = {}
    for name in names:
        for b in a.batch:
            med = statistics.median(x["tokens_per_s"] for x in rows if x["variant"] == name and x["batch"] == b)
            summary[f"{name}/b{b}"] = med
            extra = f"  ratio {med / bound:.3f}" if b == 1 else ""
            print(f"  {name:14s} batch {b}: {med:8.1f} tok/s {1e3 * b / med:6.2f} ms/step "
                  f"({med / summary[f'{names[0]}/b{b}']:.3f}x {names[0]}){extra}")
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_bw": bw, "bound_b1": bound, "rows": rows, "medians": summary},
                                          indent=2))


if __name__ == "__main__":
    main()
