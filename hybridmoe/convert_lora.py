"""`hybridmoe convert-lora` / `python -m hybridmoe.convert_lora`: a KTransformers SFT output directory
(fused-expert LoRA, formats: lora/kt_checkpoint.py) -> a PEFT adapter directory (adapter_model.safetensors
+ adapter_config.json) that `--lora-paths` (and SGLang, PEFT) load.

    hybridmoe convert-lora INPUT OUTPUT --base-model-name-or-path X [--lora-alpha A] [--overwrite]
                           [--expert-output-dir D | --nonexpert-output-dir D]

Without a split flag OUTPUT holds both halves. --expert-output-dir D: the routed experts' half goes to
D (serve it with --kt-expert-lora-path D) and OUTPUT keeps the non-expert half (--lora-paths OUTPUT);
--nonexpert-output-dir D is the other way round. Each directory gets its own adapter_config.json.

Streamed: the input headers are checked first (nothing is written for a malformed input), then each
output file's header is written and the input tensors are copied into it one at a time (a fused
[E, ...] tensor's bytes are its E per-expert tensors back to back), so memory holds one input tensor.
Files are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from itertools import groupby
from pathlib import Path

from hybridmoe.args import OneLineParser
from hybridmoe.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, all_finite
from hybridmoe.lora.kt_checkpoint import EXPERT_PROJS, ConvertLoRAError, KTInput, Source, read_input
from hybridmoe.weights.safetensors_stream import StreamWriter

log = logging.getLogger("hybridmoe.convert_lora")
PROG = "hybridmoe convert-lora"


def _destinations(input_path: Path, output: Path, expert_dir: str | None, nonexpert_dir: str | None,
                  overwrite: bool) -> list[tuple[Path, str]]:
    """(directory, half) to write: half is 'both', 'expert' or 'nonexpert'. Checks the directories."""
    if expert_dir and nonexpert_dir:
        raise ConvertLoRAError("--expert-output-dir with --nonexpert-output-dir would leave OUTPUT empty: give one "
                               "of them (OUTPUT holds the other half)")
    if expert_dir:
        dests = [(output, "nonexpert"), (Path(expert_dir), "expert")]
    elif nonexpert_dir:
        dests = [(output, "expert"), (Path(nonexpert_dir), "nonexpert")]
    else:
        dests = [(output, "both")]
    if len(dests) == 2 and dests[0][0].resolve() == dests[1][0].resolve():
        flag = "--expert-output-dir" if expert_dir else "--nonexpert-output-dir"
        raise ConvertLoRAError(f"{flag} {dests[1][0]}: the same directory as OUTPUT; the halves need two directories")
    src = input_path.resolve()
    for d, _ in dests:
        r = d.resolve()
        if r == src or src in r.parents:
            raise ConvertLoRAError(f"{d}: inside the input directory {input_path}; write the output elsewhere")
        if d.exists() and not d.is_dir():
            raise ConvertLoRAError(f"{d}: exists and is not a directory")
        if d.is_dir() and any(d.iterdir()) and not overwrite:
            raise ConvertLoRAError(f"{d}: exists and is not empty; pass --overwrite to replace its adapter files")
    return dests


def adapter_config(kt: KTInput, half: str, base_model: str) -> dict:
    """The adapter_config.json of one output directory (target_modules: that directory's modules; both
    halves: the union with the input config's target_modules)."""
    targets = set()
    if half in ("both", "expert"):
        targets |= set(EXPERT_PROJS)
    if half in ("both", "nonexpert"):
        targets |= kt.linear_modules
    if half == "both":
        targets |= kt.config_targets
    return {"peft_type": "LORA", "r": kt.rank, "lora_alpha": kt.lora_alpha, "target_modules": sorted(targets),
            "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model}


def _write_tensors(file: Path, sources: list[Source], kt: KTInput) -> None:
    from safetensors import safe_open

    last = {s.layer: i for i, s in enumerate(sources) if s.layer is not None}  # layer -> its last source
    done = 0
    with StreamWriter(file, [e for s in sources for e in s.outputs], {"format": "pt"}) as w:
        i = 0
        for src_file, group in groupby(sources, key=lambda s: s.file):
            with safe_open(str(src_file), framework="pt") as f:
                for s in group:
                    t = f.get_tensor(s.key)
                    if t.is_floating_point() and not all_finite(t):  # served, its requests' outputs would be NaN
                        raise ConvertLoRAError(f"{src_file}: {s.key} holds NaN or infinite values (did the training "
                                               "diverge?)")
                    w.write(t)
                    if s.layer is not None and last[s.layer] == i:
                        done += 1
                        log.info("layer %d: %d experts' LoRA written (rank %d) [%d/%d layers]", s.layer,
                                 kt.num_experts, kt.rank, done, len(last))
                    i += 1
    n_lin = sum(s.layer is None for s in sources)
    if n_lin:
        log.info("%d non-expert LoRA tensors written", n_lin)


def _write_dir(d: Path, sources: list[Source], cfg: dict, kt: KTInput) -> None:
    d.mkdir(parents=True, exist_ok=True)
    _write_tensors(d / WEIGHTS_FILE, sources, kt)
    tmp = d / f"{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, d / CONFIG_FILE)


def convert(input_path: str | Path, output: str | Path, base_model: str, lora_alpha: float | None = None,
            overwrite: bool = False, expert_dir: str | None = None,
            nonexpert_dir: str | None = None) -> list[tuple[Path, str]]:
    """Convert; returns the (directory, half) written. Raises ConvertLoRAError for a bad input or option."""
    if not base_model:
        raise ConvertLoRAError("--base-model-name-or-path: expected the base model's name or path")
    inp, out = Path(input_path), Path(output)
    dests = _destinations(inp, out, expert_dir, nonexpert_dir, overwrite)
    kt = read_input(inp, lora_alpha)
    if len(dests) == 2 and not kt.linears:
        flag = "--expert-output-dir" if expert_dir else "--nonexpert-output-dir"
        where = "OUTPUT" if expert_dir else nonexpert_dir
        raise ConvertLoRAError(f"{inp}: no non-expert tensors ({WEIGHTS_FILE}), so {where} would be empty; "
                               f"drop {flag}")
    log.info("%s: %d MoE layers, %d experts, rank %d, lora_alpha %s, %d non-expert tensors", inp, len(kt.layers),
             kt.num_experts, kt.rank, kt.lora_alpha, len(kt.linears))
    for d, half in dests:
        sources = {"both": kt.experts + kt.linears, "expert": kt.experts, "nonexpert": kt.linears}[half]
        created = not d.exists()
        try:
            _write_dir(d, sources, adapter_config(kt, half, base_model), kt)
        except BaseException:  # a tensor found bad while streaming: leave no directory this run made empty
            if created and d.is_dir() and not any(d.iterdir()):
                d.rmdir()
            raise
    return dests


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return int(v) if v.is_integer() and "." not in text and "e" not in text.lower() else v


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="KTransformers SFT output (fused-expert LoRA) -> PEFT adapter "
                      "directory for --lora-paths", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("input", metavar="INPUT", help="the SFT output directory (fused_expert_lora.safetensors, "
                   "optional adapter_model.safetensors and adapter_config.json)")
    p.add_argument("output", metavar="OUTPUT", help="the adapter directory to write")
    p.add_argument("--base-model-name-or-path", required=True, help="base_model_name_or_path of adapter_config.json")
    p.add_argument("--lora-alpha", type=_number, default=None,
                   help="lora_alpha when INPUT/adapter_config.json has none (its value wins)")
    p.add_argument("--overwrite", action="store_true", help="replace the adapter files of existing output directories")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--expert-output-dir", default=None,
                       help="write the routed experts' half here (--kt-expert-lora-path); OUTPUT keeps the rest")
    split.add_argument("--nonexpert-output-dir", default=None,
                       help="write the non-expert half here; OUTPUT keeps the experts' half")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from hybridmoe.log import configure

    configure(ns.log_level)
    try:
        dests = convert(ns.input, ns.output, ns.base_model_name_or_path, ns.lora_alpha, ns.overwrite,
                        ns.expert_output_dir, ns.nonexpert_output_dir)
    except ConvertLoRAError as e:  # a bad input or option: one line, exit code 2
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (no incomplete file was put in place)", file=sys.stderr)
        return 130
    except Exception as e:  # e.g. a full disk: one line (the traceback with --log-level debug)
        from hybridmoe.startup import report_failure

        return report_failure(PROG, e, ns.log_level == "debug")
    by_half = {half: d for d, half in dests}
    if "both" in by_half:
        print(f"{by_half['both']}: done; serve with --lora-paths NAME={by_half['both']}")
    else:
        print(f"{by_half['nonexpert']} (non-expert), {by_half['expert']} (experts): done; serve with "
              f"--lora-paths NAME={by_half['nonexpert']} --kt-expert-lora-path {by_half['expert']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
