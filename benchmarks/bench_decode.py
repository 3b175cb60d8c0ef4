"""Decode throughput of a full-size MoE model with random weights, all experts on the GPU.

Default shape: Qwen3-30B-A3B (48 layers, 128 experts, top-8, hidden 2048, expert intermediate 768,
32 query / 4 kv heads of 128, vocabulary 151936); --dummy-deepseek-v3 / --dummy-kimi-k2 the published
configs of those (shapes.py), --layers N cutting the depth. For each batch size and with CUDA graphs on and
off, prints decode tokens/s; for batch 1 also the bound = bytes of weights read per token / the
device-to-device copy bandwidth measured in the same run, and the ratio to it.

    python benchmarks/bench_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import add_dummy_flags, apply_dummy_shape  # noqa: E402

QWEN3_30B_LAYERS = 48


def write_config(d: Path, a: argparse.Namespace) -> None:
    """config.json of the benchmark model: the --dummy-* model's (shapes.py), else a Qwen3-MoE of the
    shape flags."""
    if getattr(a, "dummy_config", None) is not None:
        (d / "config.json").write_text(json.dumps(a.dummy_config))
        return
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": a.vocab,
        "hidden_size": a.hidden, "intermediate_size": 6144, "moe_intermediate_size": a.inter,
        "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim, "num_experts": a.experts, "num_experts_per_tok": a.topk, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The model shape flags (default: Qwen3-30B-A3B), shared by the benchmarks that build one, and
    --dummy-deepseek-v3 / --dummy-kimi-k2 (shapes.py: they set the other shape flags; --layers N cuts
    the depth). Parse with parse_shape_args."""
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers (default: {QWEN3_30B_LAYERS}, or all of the --dummy-* model's)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    add_dummy_flags(p)


def parse_shape_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """parse_args, then the shape flags resolved (a --dummy-* model sets them from its config)."""
    a = p.parse_args(argv)
    apply_dummy_shape(a, QWEN3_30B_LAYERS)
    return a


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times = sorted(times[3:])
    del src, dst
    return 2 * nbytes / times[len(times) // 2]


def bytes_per_token(model, topk: int) -> int:
    """Weight bytes one decode token reads: every dense weight, top-k experts per MoE layer, one
    embedding row."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    elt = next(model.parameters()).element_size()
    per_expert = 3 * model.config.hidden_size * model.spec.moe_intermediate * elt
    return total + len(model.moe_blocks()) * topk * per_expert


def start_decode(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> list:
    """`batch` random prompts submitted and run through prefill and the first decode step (not
    timed); returns the requests, each with `steps` + 1 tokens left to generate."""
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    reqs = [eng.make_request(input_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                             sampling_params={"max_new_tokens": steps + 2, "temperature": 0, "ignore_eos": True})
            for _ in range(batch)]
    for r in reqs:
        eng.submit(r)
    while any(len(r.output_ids) < 2 for r in reqs):
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return reqs


def decode_tps(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    eng = llm.engine
    reqs = start_decode(llm, batch, prompt_len, steps, vocab)
    t0, n = time.perf_counter(), 0
    while not all(r.finished for r in reqs):
        n += len(eng.step())
    dt = time.perf_counter() - t0
    return n / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--moe-backend", default="triton")
    p.add_argument("--graphs", default="on,off")
    p.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                   help="overlap scheduling (the next step launched before this one's tokens are read); auto: the "
                        "engine's default (on with CUDA)")
    p.add_argument("--routing", default="model", choices=["model", "spread"],
                   help="spread: router logits shifted so that tokens reach experts nearly uniformly "
                        "(benchmarks/spread_routing.py; random weights route to a few experts otherwise)")
    p.add_argument("--out", default=None)
    a = parse_shape_args(p)

    from hybridmoe import LLM

    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)")
    results = {"shape": vars(a), "copy_bw": bw, "runs": []}
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        for mode in a.graphs.split(","):
            max_bs = max(a.batch)
            t = time.perf_counter()
            llm = LLM(d, device="cuda", dtype="bfloat16", load_format="dummy", progress=False,
                      skip_tokenizer_init=True, attention_backend=a.attention_backend, moe_backend=a.moe_backend,
                      enable_overlap_schedule=a.overlap == "on", disable_overlap_schedule=a.overlap == "off",
                      disable_cuda_graph=(mode == "off"), cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                      max_total_tokens=max_bs * (a.prompt_len + a.steps + 64), context_length=4096)
            if a.routing == "spread":
                import spread_routing

                spread_routing.install(llm)
            print(f"graphs {mode}: model ready in {time.perf_counter() - t:.1f} s (routing {a.routing})")
            bpt = bytes_per_token(llm.engine.runner.model, a.topk)
            bound = bw / bpt
            for b in a.batch:
                tps = decode_tps(llm, b, a.prompt_len, a.steps, a.vocab)
                row = {"graphs": mode, "batch": b, "tokens_per_s": tps, "ms_per_step": 1e3 * b / tps}
                if b == 1:
                    row.update(bytes_per_token=bpt, bound_tokens_per_s=bound, ratio_to_bound=tps / bound)
                results["runs"].append(row)
                extra = f"  bound {bound:.0f} tok/s, ratio {tps / bound:.2f}" if b == 1 else ""
                print(f"graphs {mode:3s} batch {b:3d}: {tps:9.1f} tok/s  {1e3 * b / tps:7.2f} ms/step{extra}",
                      flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print(f"bytes of weights per token at batch 1: {bpt / 1e9:.2f} GB")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
