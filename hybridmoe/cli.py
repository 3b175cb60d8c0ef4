"""`hybridmoe` command line: one entry point, sub-commands."""

from __future__ import annotations

import argparse
import math
import sys

from hybridmoe.args import OneLineParser, add_engine_args, engine_args_from
from hybridmoe.config import ConfigError

PROG = "hybridmoe generate"


def _check_generate_flags(ns: argparse.Namespace) -> None:
    """The flags of `generate` itself (the engine's are EngineArgs.validate's)."""
    if not 1 <= ns.max_new_tokens <= 2**31 - 1:
        raise ConfigError(f"--max-new-tokens: got {ns.max_new_tokens}, expected a positive integer")
    if not (math.isfinite(ns.temperature) and ns.temperature >= 0):
        raise ConfigError(f"--temperature: got {ns.temperature}, expected a finite number >= 0")
    if not 0 < ns.top_p <= 1:
        raise ConfigError(f"--top-p: got {ns.top_p}, expected a number in (0, 1]")
    if ns.seed is not None and not 0 <= ns.seed < 2**63:
        raise ConfigError(f"--seed: got {ns.seed}, expected an integer in [0, 2^63)")
    if not ns.prompt and not ns.chat:  # the engine refuses an empty prompt: found after the whole model load (with
        # --chat the template's text is the prompt)
        raise ConfigError("--prompt: got '', expected the text to generate from")


def _generate(ns: argparse.Namespace) -> int:
    from hybridmoe.engine.llm import LLM
    from hybridmoe.hub import resolve_hub_paths
    from hybridmoe.sglang_compat import log_ignored, refused
    from hybridmoe.startup import check_text_input, prepare

    _check_generate_flags(ns)
    bad = refused(ns)
    if bad:
        raise ConfigError("; ".join(bad))
    log_ignored(ns)
    args = prepare(resolve_hub_paths(engine_args_from(ns)))  # config, tokenizer, shards and flags: before loading anything
    check_text_input(args, "hybridmoe generate", chat=ns.chat)  # --prompt is text: a tokenizer (and --chat's template)
    llm = LLM.from_prepared(args)  # (not LLM(...): that would run the checks again)
    prompt = ns.prompt
    if ns.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p}
    if ns.seed is not None:
        params["sampling_seed"] = ns.seed
    print(ns.prompt, end="" if not ns.chat else "\n", flush=True)
    shown = ""
    for chunk in llm.generate(prompt=prompt, sampling_params=params, stream=True):
        print(chunk["text"][len(shown):], end="", flush=True)  # text is cumulative
        shown = chunk["text"]
    meta = chunk["meta_info"]
    print(f"\n[{meta['completion_tokens']} tokens, finish {meta['finish_reason']}, {meta['e2e_latency']:.2f} s]")
    return 1 if (meta["finish_reason"] or {}).get("type") == "abort" else 0  # the request failed: say so to scripts


def _not_yet(name: str) -> int:
    print(f"hybridmoe {name}: not yet available in this version", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="hybridmoe", description="Serve MoE LLMs on one GPU plus a large CPU.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion offline (no server)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       usage="%(prog)s [--model-path PATH] [--prompt TEXT] [OPTIONS]  (the options are listed below)")
    add_engine_args(g)
    g.add_argument("--prompt", default="The module provides", help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=None, help="sampling seed; unset: random")
    sub.add_parser("serve", help="HTTP server (SGLang and OpenAI APIs); `hybridmoe serve --help` for its flags",
                   add_help=False)
    sub.add_parser("check", help="environment report and recommended flags", add_help=False)
    sub.add_parser("convert", help="HF checkpoint -> CPU expert weights for --kt-weight-path; "
                   "`hybridmoe convert --help` for its flags", add_help=False)
    sub.add_parser("convert-lora", help="KTransformers fused-expert LoRA checkpoint -> PEFT adapter dir for "
                   "--lora-paths; `hybridmoe convert-lora --help` for its flags", add_help=False)
    sub.add_parser("bench", help="benchmarks: one-batch (latency of one batch), serving (concurrent clients); "
                   "`hybridmoe bench --help`", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from hybridmoe.launch_server import serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["check"]:
        from hybridmoe.check import check_main

        return check_main(argv[1:])
    if argv[:1] == ["bench"]:
        from hybridmoe.bench import bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["convert"]:
        from hybridmoe.convert import main as convert_main

        return convert_main(argv[1:])
    if argv[:1] == ["convert-lora"]:
        from hybridmoe.convert_lora import main as convert_lora_main

        return convert_lora_main(argv[1:])
    ns, extra = build_parser().parse_known_args(argv)
    if extra:  # named by the sub-command's parser, like every other flag error
        OneLineParser(prog=f"hybridmoe {ns.command}").error(f"unrecognized arguments: {' '.join(extra)}")
    level = getattr(ns, "log_level", "info").upper()
    from hybridmoe.log import configure

    configure(level)
    if ns.command == "generate":
        from hybridmoe.startup import report_failure

        try:
            return _generate(ns)
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # a bad model or flag: one line, not a traceback (unless --log-level debug)
            return report_failure(PROG, e, ns.log_level == "debug")
    return _not_yet(ns.command)


if __name__ == "__main__":
    sys.exit(main())
