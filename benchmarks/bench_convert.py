"""Memory and speed of `hybridmoe convert` on a synthetic checkpoint (never part of the test suite).

Writes a Qwen3-MoE-shaped checkpoint of random bf16 routed experts (default: 24 MoE layers of 128
experts x (2048 x 768 x 3), one shard per layer, like Qwen3-30B-A3B) to a temporary directory,
converts it in a subprocess, and prints that subprocess's peak resident memory (ru_maxrss) and the
time per GB of input; then reads every layer back as the server does (one verified read each) and
prints the load rate. Cleans up unless --keep.

    python benchmarks/bench_convert.py [--layers 24] [--method int8] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from hybridmoe.weights.cpu_format import CPUWeightDir, write_safetensors


def write_checkpoint(root: Path, layers: int, experts: int, hidden: int, inter: int) -> float:
    """A config.json and one safetensors shard per layer holding only the routed experts; GB written."""
    root.mkdir(parents=True)
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=hidden,
               intermediate_size=4 * inter, moe_intermediate_size=inter, num_hidden_layers=layers,
               num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=experts,
               num_experts_per_tok=min(8, experts), norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
               vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
               torch_dtype="bfloat16", tie_word_embeddings=False)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    pool = (torch.randn(1 << 26, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    rng = torch.Generator().manual_seed(1)
    weight_map, total = {}, 0
    for layer in range(layers):
        shard = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        tensors = {}
        for e in range(experts):
            for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                n = shape[0] * shape[1]
                off = int(torch.randint(0, pool.numel() - n, (1,), generator=rng))
                key = f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"
                tensors[key] = pool[off:off + n].view(shape)  # random slices of one random pool
                weight_map[key] = shard
        nbytes, _ = write_safetensors(root / shard, tensors, {"format": "pt"})
        total += nbytes
        print(f"\rwriting the synthetic checkpoint: layer {layer + 1}/{layers}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total / 1e9


def rss_sampler(pid: int, samples: list[float], stop: threading.Event) -> None:
    """VmRSS of `pid` (GB) twice a second, for the trend."""
    while not stop.wait(0.5):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    samples.append(int(line.split()[1]) / 1e6)
        except OSError:
            return


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--method", default="int8", help="--quant-method of the conversion")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dir", default=None, help="where to put the temporary directory (default: $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=a.dir))
    try:
        t0 = time.perf_counter()
        in_gb = write_checkpoint(work / "ckpt", a.layers, a.experts, a.hidden, a.inter)
        write_s = time.perf_counter() - t0
        print(f"checkpoint: {in_gb:.2f} GB written in {write_s:.0f} s", file=sys.stderr)
        cmd = [sys.executable, "-m", "hybridmoe.convert", "--input-path", str(work / "ckpt"), "--output",
               str(work / "out"), "--quant-method", a.method, "--input-type", "bf16"]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        samples: list[float] = []
        stop = threading.Event()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd)
        sampler = threading.Thread(target=rss_sampler, args=(proc.pid, samples, stop), daemon=True)
        sampler.start()
        rc = proc.wait()
        secs = time.perf_counter() - t0
        stop.set()
        peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6  # KiB -> ~GB
        if rc != 0:
            print(f"the conversion failed with exit code {rc}", file=sys.stderr)
            return 1
        out_gb = sum(f.stat().st_size for f in (work / "out").iterdir()) / 1e9
        d = CPUWeightDir(work / "out")
        t1 = time.perf_counter()
        for layer in d.manifest["moe_layers"]:
            d.load_layer(layer)  # one read + sha256 + views, as --kt-weight-path does
        load_s = time.perf_counter() - t1
        res = {"layers": a.layers, "experts": a.experts, "hidden": a.hidden, "inter": a.inter, "method": a.method,
               "threads": a.threads or os.cpu_count(), "input_gb": round(in_gb, 3), "output_gb": round(out_gb, 3),
               "convert_s": round(secs, 1), "s_per_gb": round(secs / in_gb, 2), "gb_per_s": round(in_gb / secs, 3),
               "peak_rss_gb": round(peak_gb, 3), "rss_p50_gb": round(sorted(samples)[len(samples) // 2], 3)
               if samples else None, "load_verify_s": round(load_s, 1),
               "load_gb_per_s": round(out_gb / load_s, 3)}
        print("\n| " + " | ".join(res) + " |\n|" + "---|" * len(res) + "\n| " +
              " | ".join(str(v) for v in res.values()) + " |")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    finally:
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
