"""Decode step time with a json_schema grammar against none, in the same run (structured output's cost).

A Qwen3-MoE of random weights (bench_decode.py's shape flags; default here: 4 layers of Qwen3-30B-A3B's
widths and its 151936-token vocabulary, since the bitmask's cost grows with the vocabulary), all on one
device. The grammar backend gets a synthetic vocabulary of that size (the model has no tokenizer): the
JSON punctuation, letters and digits as single tokens, the rest words; the schema is one string field,
so after the forced prefix (`--warm` covers it, whitespace included) the timed steps are inside the string,
as with long JSON values; each row records the text of one request, to check that.

For each repeat and batch size both modes run back to back (their order alternating by repeat), each
timing `--steps` engine steps after `--warm` untimed ones; the summary is the median ms per step of each
mode and the ratio grammar / none (the target: at most 1.05). Also printed: the host time of filling the
batch's bitmask alone (it overlaps the forward when the GPU still computes).

    python benchmarks/bench_grammar.py --out grammar.json                       # H200
    python benchmarks/bench_grammar.py --device cpu --layers 1 --hidden 64 ...  # smoke (tests)
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

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
EOS = 0


def synthetic_vocab(size: int) -> list[str]:
    """Token id -> text: <eos>, printable ASCII one character each, then distinct letter words."""
    vocab = ["<eos>"] + [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(vocab) < size:
        word, n = "", i
        while True:  # i in base 26, at least two letters (the single ones are above)
            word = letters[n % 26] + word
            n //= 26
            if n == 0 and len(word) >= 2:
                break
        vocab.append((" " if i % 3 == 0 else "") + word)
        i += 1
    return vocab[:size]


def run_mode(llm, batch: int, grammar: bool, a: argparse.Namespace, seed: int, vocab: list[str]) -> dict:
    """ms per decode step of `batch` requests (one mode), after prefill and a.warm untimed steps."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = {"max_new_tokens": a.warm + a.steps + 4, "temperature": 0, "ignore_eos": True}
    if grammar:
        params["json_schema"] = json.dumps(SCHEMA)
    reqs = [eng.make_request(input_ids=torch.randint(1, a.vocab, (a.prompt_len,), generator=g).tolist(),
                             sampling_params=params) for _ in range(batch)]
    for r in reqs:
        eng.submit(r)
    while any(len(r.output_ids) < a.warm for r in reqs):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    dt = time.perf_counter() - t0
    early = sum(r.finished for r in reqs)
    text = "".join(vocab[t] for t in reqs[0].output_ids)[:200]  # with the grammar, a prefix of what it allows
    for r in reqs:  # clear the engine for the next run
        eng.abort(r.rid)
    while eng.has_work():
        eng.step()
    return {"ms_per_step": 1e3 * dt / a.steps, "finished_early": early, "text": text}


def fill_us(llm, batch: int, n: int = 200) -> float:
    """Host microseconds of one batch bitmask fill (in-string state), median of n."""
    from hybridmoe.engine.grammar import RequestGrammar

    be = llm.engine.grammars.backend
    grammars = []
    for _ in range(batch):
        rg = RequestGrammar(be.compile("json_schema", json.dumps(SCHEMA)))
        rg.matcher.accept_string('{"text": "abc')
        grammars.append(rg)
    sampler = llm.engine.sampler
    dev = llm.engine.runner.device
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sampler.bitmask.fill(grammars, dev)
        times.append(time.perf_counter() - t)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warm", type=int, default=128,
                   help="untimed decode steps first: past the JSON prefix (up to 32 whitespace characters per gap)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--moe-backend", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--out", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--layers" not in argv and not any(x.startswith("--dummy-") for x in argv):
        argv += ["--layers", "4"]
    a = parse_shape_args(p, argv)

    from hybridmoe import LLM
    from hybridmoe.engine.grammar import GrammarBackend

    cuda = a.device == "cuda"
    max_bs = max(a.batch)
    opts = {k: v for k, v in (("attention_backend", a.attention_backend), ("moe_backend", a.moe_backend)) if v}
    results: dict = {"shape": vars(a), "runs": [], "summary": []}
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        t = time.perf_counter()
        llm = LLM(d, device=a.device, dtype="bfloat16" if cuda else "float32", load_format="dummy", progress=False,
                  skip_tokenizer_init=True, disable_cuda_graph=a.disable_cuda_graph or not cuda,
                  cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                  max_total_tokens=max_bs * (a.prompt_len + a.warm + a.steps + 64), context_length=4096, **opts)
        vocab = synthetic_vocab(a.vocab)
        llm.engine.grammars.set_backend(GrammarBackend.for_vocab(vocab, [EOS], vocab_size=a.vocab))
        graphs = llm.engine.runner.graphs is not None
        print(f"model ready in {time.perf_counter() - t:.1f} s (CUDA graphs {'on' if graphs else 'off'})", flush=True)
        for rep in range(a.repeat):
            for b in a.batch:
                for grammar in ((False, True) if rep % 2 == 0 else (True, False)):
                    row = dict(run_mode(llm, b, grammar, a, 1000 * rep + b, vocab), rep=rep, batch=b, grammar=grammar)
                    results["runs"].append(row)
                    print(f"rep {rep} batch {b:3d} grammar {'on ' if grammar else 'off'}: "
                          f"{row['ms_per_step']:8.3f} ms/step" + (f"  ({row['finished_early']} ended early)"
                                                                  if row["finished_early"] else ""), flush=True)
        for b in a.batch:
            med = {g: statistics.median(r["ms_per_step"] for r in results["runs"] if r["batch"] == b
                                        and r["grammar"] == g) for g in (False, True)}
            entry = {"batch": b, "median_ms_none": med[False], "median_ms_grammar": med[True],
                     "ratio": med[True] / med[False], "fill_us": fill_us(llm, b), "runs": a.repeat}
            results["summary"].append(entry)
            print(f"batch {b:3d}: median {entry['median_ms_none']:.3f} ms/step without a grammar, "
                  f"{entry['median_ms_grammar']:.3f} with; ratio {entry['ratio']:.3f} (target <= 1.05); "
                  f"bitmask fill {entry['fill_us']:.0f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
