"""SGLang `launch_server` flags that have no feature of their own in hybridmoe, as parser arguments and startup
checks: what each maps to, which are accepted because they change nothing here (one log line each), and which
are refused (with the reason). The catalogue itself, every flag with its value form and decision, is
sglang_flags.py.

A command line written for `python -m sglang.launch_server` (and KTransformers' kt-sglang guide)
must parse under `python -m hybridmoe.launch_server`: every flag is either honoured, accepted with
a stated no-op reason, or refused with a one-line message naming it and why (exit code 2); never
"unrecognized arguments".
"""

from __future__ import annotations

import argparse
import logging
import math

from hybridmoe.sglang_flags import NO_OP, NO_OPS, REFUSALS, SINGLE_DEVICE_FLAGS, VALUES, SGLangFlag

log = logging.getLogger(__name__)

# SGLang's --attention-backend names -> ours. None: the device default (triton on CUDA, torch on
# the CPU); hybridmoe has no FlashInfer/FlashAttention/FlashMLA kernels of its own.
ATTENTION_BACKEND_ALIASES: dict[str, str | None] = {
    "torch": "torch", "torch_native": "torch", "sdpa": "torch", "intel_amx": "torch",
    "triton": "triton",
    "flashinfer": None, "fa3": None, "fa4": None, "flashmla": None, "cutlass_mla": None, "trtllm_mla": None,
    "trtllm_mha": None, "flex_attention": None, "aiter": None, "wave": None, "cutedsl_mla": None,
    "tokenspeed_mla": None,
}

# --kv-cache-dtype values (SGLang's names; bf16/bfloat16 are ours and newer SGLang's)
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")

SCHEDULE_POLICIES = ("fcfs", "lpm")

# (flag, reason) of the switches accepted with no effect, and of every refused spelling; the parallelism sizes
# (SINGLE_DEVICE_FLAGS) are sglang_flags.py's
NO_OP_FLAGS: tuple[tuple[str, str], ...] = tuple((f.names[0], f.reason) for f in NO_OPS if f.takes == "0")
REFUSED_FLAGS: tuple[tuple[str, str], ...] = tuple((name, f.reason) for f in REFUSALS for name in f.names)

SPELLINGS = "_sglang_spellings"  # namespace attribute: dest -> the spelling given on the command line
_NARGS = {"0": 0, "1": None, "+": "+", "*": "*", "?": "?"}


class _Given(argparse.Action):
    """Stores the value (True for a switch) and notes which spelling was given: what the log line or the
    refusal names."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        seen = dict(getattr(namespace, SPELLINGS, {}))
        seen[self.dest] = option_string
        setattr(namespace, SPELLINGS, seen)


def _add(group, flag: SGLangFlag, nargs, help_text: str, default) -> None:
    group.add_argument(*flag.names, dest=flag.dest, action=_Given, nargs=nargs, default=default,
                       metavar=None if nargs == 0 else "VALUE", help=help_text)


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """The flags of sglang_flags.py that are not hybridmoe's own, in three groups of --help (the refused ones
    are not listed there: each names itself when given)."""
    g = p.add_argument_group("SGLang compatibility (accepted; single-device values only)")
    for flags, default, reason in SINGLE_DEVICE_FLAGS:
        g.add_argument(*flags, dest=flags[0].lstrip("-").replace("-", "_"), type=int, default=default,
                       help=f"only {default} is supported: {reason}")
    for flag in VALUES:
        _add(g, flag, _NARGS[flag.takes], f"only {' or '.join(flag.accepted)} is accepted: {flag.reason}", None)
    n = p.add_argument_group("SGLang flags accepted with no effect here (a log line at startup says so)")
    for flag in NO_OPS:
        _add(n, flag, _NARGS[flag.takes], flag.reason, False if flag.takes == "0" else None)
    r = p.add_argument_group("SGLang flags that are refused",
                             "every other flag of sglang.launch_server (see hybridmoe/sglang_flags.py) is refused "
                             "when given: the server does not start, and one line names the flag and says why")
    for flag in REFUSALS:  # any number of values: the refusal, not a parse error, is what is reported
        _add(r, flag, "*", argparse.SUPPRESS, argparse.SUPPRESS)


def _spelling(ns: argparse.Namespace, flag: SGLangFlag) -> str | None:
    """The spelling of `flag` given on the command line, or None if it was not given."""
    return getattr(ns, SPELLINGS, {}).get(flag.dest)


def _is_accepted(value: str, accepted: tuple[str, ...]) -> bool:
    if value in accepted:
        return True
    try:  # numbers compare as numbers: 1.0 is 1
        return any(math.isclose(float(value), float(a)) for a in accepted)
    except ValueError:
        return False


def refused(ns: argparse.Namespace) -> list[str]:
    """One line per flag given that is refused: 'FLAG: reason'."""
    bad = []
    for flags, default, reason in SINGLE_DEVICE_FLAGS:
        value = getattr(ns, flags[0].lstrip("-").replace("-", "_"), default)
        if value != default:
            bad.append(f"{flags[0]} {value}: only {default} is supported; {reason}")
    for flag in VALUES:
        spelling = _spelling(ns, flag)
        value = getattr(ns, flag.dest, None)
        if spelling is not None and not _is_accepted(str(value), flag.accepted):
            bad.append(f"{spelling} {value}: only {' or '.join(flag.accepted)} is accepted; {flag.reason}")
    for flag in REFUSALS:
        spelling = _spelling(ns, flag)
        if spelling is not None:
            bad.append(f"{spelling}: {flag.reason}; remove the flag")
    return bad


def ignored(ns: argparse.Namespace) -> list[str]:
    """One line per flag given that is accepted with no effect: 'FLAG: reason'."""
    return [f"{spelling}: {flag.reason}" for flag in NO_OPS if flag.decision == NO_OP
            and (spelling := _spelling(ns, flag)) is not None]


def log_ignored(ns: argparse.Namespace) -> None:
    for line in ignored(ns):
        log.info("%s", line)
