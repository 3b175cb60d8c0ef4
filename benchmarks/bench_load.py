"""Time to load a bf16 checkpoint with load-time quantization of its experts (no --kt-weight-path).

Writes a random Qwen3-MoE checkpoint (default: issue 21's model, 6 layers of the Qwen3-30B-A3B shape:
every tensor a real checkpoint has, one shard per layer) to a temporary directory, then builds
`LLM(dir, device="cpu", kt_method=M, kt_num_gpu_experts=0)` for each method in a fresh subprocess (a
cold engine each time; the file is in the page cache after the write, as after a first load) and
prints the seconds until the model is ready and the rate in GB/s of bf16 expert input. Never part of
the test suite.

    python benchmarks/bench_load.py [--layers 6] [--methods AMXINT8,AMXINT4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridmoe.weights.cpu_format import write_safetensors


def write_checkpoint(root: Path, a: argparse.Namespace) -> tuple[float, float]:
    """config.json, one shard per layer plus one for the embeddings and head; (GB of experts, GB in all)."""
    root.mkdir(parents=True)
    h, i, e, hq, hkv, d = a.hidden, a.inter, a.experts, a.heads, a.kv_heads, a.head_dim
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=h,
               intermediate_size=4 * i, moe_intermediate_size=i, num_hidden_layers=a.layers,
               num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, num_experts=e,
               num_experts_per_tok=min(8, e), norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
               vocab_size=a.vocab, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
               torch_dtype="bfloat16", tie_word_embeddings=False, rope_theta=1e6)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    pool = (torch.randn(1 << 26, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    rng = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:  # a random slice of one random pool: fast, and not all alike
        n = shape[0] * shape[1]
        if n > pool.numel() // 2:  # the embeddings and the head: drawn whole
            return (torch.randn(shape, generator=rng) * 0.02).to(torch.bfloat16)
        off = int(torch.randint(0, pool.numel() - n, (1,), generator=rng))
        return pool[off:off + n].view(shape)

    weight_map: dict[str, str] = {}
    experts_gb = total_gb = 0.0

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total_gb
        nbytes, _ = write_safetensors(root / name, tensors, {"format": "pt"})
        total_gb += nbytes / 1e9
        weight_map.update(dict.fromkeys(tensors, name))

    shard("model-head.safetensors", {"model.embed_tokens.weight": rand(a.vocab, h),
                                     "lm_head.weight": rand(a.vocab, h),
                                     "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for layer in range(a.layers):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rand(hq * d, h), p + "self_attn.k_proj.weight": rand(hkv * d, h),
             p + "self_attn.v_proj.weight": rand(hkv * d, h), p + "self_attn.o_proj.weight": rand(h, hq * d),
             p + "mlp.gate.weight": rand(e, h)}
        for x in range(e):
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                t[f"{p}mlp.experts.{x}.{name}.weight"] = rand(*shape)
                experts_gb += shape[0] * shape[1] * 2 / 1e9
        shard(f"model-{layer + 1:05d}-of-{a.layers:05d}.safetensors", t)
        print(f"\rwriting the checkpoint: layer {layer + 1}/{a.layers}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return experts_gb, total_gb


CHILD = """
import json, sys, time
t0 = time.perf_counter()
from hybridmoe import LLM
llm = LLM(sys.argv[1], device="cpu", dtype="bfloat16", kt_method=sys.argv[2], kt_num_gpu_experts=0,
          skip_tokenizer_init=True, max_running_requests=1, max_total_tokens=512, context_length=512,
          **({"kt_cpuinfer": int(sys.argv[3])} if sys.argv[3] != "0" else {}))
ready = time.perf_counter() - t0
out = llm.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2, "temperature": 0})
print(json.dumps({"ready_s": ready, "tokens": len(out[0]["output_ids"])}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--methods", default="AMXINT8,AMXINT4")
    p.add_argument("--threads", type=int, default=0, help="--kt-cpuinfer (default: the engine's choice)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dir", default=None, help="where to put the temporary directory (default: $TMPDIR)")
    p.add_argument("--cold", action="store_true",
                   help="drop the page cache before each load (root): the checkpoint read from the disk")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (its path is printed)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_load_", dir=a.dir))
    try:
        t0 = time.perf_counter()
        experts_gb, total_gb = write_checkpoint(work / "ckpt", a)
        os.sync()  # its writeback would otherwise overlap the first load
        print(f"checkpoint: {total_gb:.2f} GB ({experts_gb:.2f} GB of bf16 experts) written in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        res: dict = {"layers": a.layers, "cold": a.cold, "experts_gb": round(experts_gb, 3), "total_gb": round(total_gb, 3),
                     "experts_bytes": round(experts_gb * 1e9),
                     "runs": []}
        for r in range(a.repeats):
            for m in a.methods.split(","):
                if a.cold:
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                t1 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-c", CHILD, str(work / "ckpt"), m, str(a.threads)],
                                      capture_output=True, text=True)
                wall = time.perf_counter() - t1
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    print(f"{m}: the load failed (exit code {proc.returncode})")
                    return 1
                child = json.loads(proc.stdout.strip().splitlines()[-1])
                run = {"round": r, "method": m, "ready_s": round(child["ready_s"], 2),
                       "process_s": round(wall, 2), "experts_gb_per_s": round(experts_gb / child["ready_s"], 3)}
                res["runs"].append(run)
                print(f"round {r} {m}: model ready in {run['ready_s']:.1f} s ({run['experts_gb_per_s']:.2f} GB/s "
                      f"of bf16 experts, imports included); process {run['process_s']:.1f} s with 2 decode steps",
                      flush=True)
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
