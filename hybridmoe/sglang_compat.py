"""SGLang `launch_server` flags that have no feature of their own in hybridmoe: what each maps to,
which are accepted because they change nothing here, and which are refused (with the reason).

A command line written for `python -m sglang.launch_server` (and KTransformers' kt-sglang guide)
must parse under `python -m hybridmoe.launch_server`: every flag is either honoured, accepted with
a stated no-op reason, or refused with a one-line message naming it and why (exit code 2); never
"unrecognized arguments".
"""

from __future__ import annotations

import argparse

# SGLang's --attention-backend names -> ours. None: the device default (triton on CUDA, torch on
# the CPU); hybridmoe has no FlashInfer/FlashAttention/FlashMLA kernels of its own.
ATTENTION_BACKEND_ALIASES: dict[str, str | None] = {
    "torch": "torch", "torch_native": "torch", "sdpa": "torch", "intel_amx": "torch",
    "triton": "triton",
    "flashinfer": None, "fa3": None, "fa4": None, "flashmla": None, "cutlass_mla": None, "trtllm_mla": None,
    "trtllm_mha": None, "flex_attention": None, "aiter": None, "wave": None,
}

# --kv-cache-dtype values (SGLang's names; bf16/bfloat16 are ours and newer SGLang's)
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")

SCHEDULE_POLICIES = ("fcfs", "lpm")

# Flags whose value must be 1 (or 0): parallelism across GPUs/nodes is not built. (flags, default, reason)
SINGLE_DEVICE_FLAGS: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("--tp-size", "--tensor-parallel-size"), 1,
     "tensor parallelism is not built: hybridmoe runs a model on one GPU (plus the CPU); scale out with "
     "replicas behind sglang-router"),
    (("--dp-size", "--data-parallel-size"), 1,
     "data parallelism inside one server is not built: run one hybridmoe server per GPU behind sglang-router"),
    (("--ep-size", "--expert-parallel-size", "--ep"), 1,
     "expert parallelism across GPUs is not built: the routed experts are split between one GPU and the CPU "
     "(--kt-num-gpu-experts)"),
    (("--pp-size", "--pipeline-parallel-size"), 1, "pipeline parallelism is not built: one GPU per server"),
    (("--nnodes",), 1, "multi-node serving is not built: one host per server"),
    (("--node-rank",), 0, "multi-node serving is not built: one host per server"),
)

# Accepted, no effect here: (flag, reason shown in --help)
NO_OP_FLAGS: tuple[tuple[str, str], ...] = (
    ("--enable-mixed-chunk", "accepted; always on here: the scheduler puts prefill chunks and decode tokens in "
                             "one batch"),
    ("--enable-p2p-check", "accepted, no effect: one GPU per server, no peer-to-peer access to check"),
    ("--disable-shared-experts-fusion", "accepted; always so here: shared experts run as their own GPU MLP, never "
                                        "fused into the routed experts' kernel"),
    ("--disable-custom-all-reduce", "accepted, no effect: one GPU per server, no all-reduce"),
    ("--enable-piecewise-cuda-graph", "accepted; on by default here: prompt batches up to "
                                      "--cuda-graph-max-prefill-tokens replay whole-model graphs"),
    ("--enforce-piecewise-cuda-graph", "accepted, no effect: prefill graphs run wherever they can; where they "
                                       "cannot (CPU experts, LoRA, MLA) a log line says why"),
)

# Refused: (flag, reason); each takes any number of values so that the refusal, not a parse error, is reported
REFUSED_FLAGS: tuple[tuple[str, str], ...] = (
    ("--lora-backend", "the LoRA kernels are hybridmoe's own (Triton on CUDA, torch on the CPU); leave it out"),
    ("--kt-lora-path", "give the non-expert half as --lora-paths and the expert half as --kt-expert-lora-path"),
    ("--enable-torch-compile", "torch.compile is not used: decode runs in CUDA graphs of Triton kernels "
                               "(--disable-cuda-graph turns them off)"),
    ("--torch-compile-max-bs", "torch.compile is not used: decode runs in CUDA graphs (--cuda-graph-max-bs)"),
    ("--cuda-graph-bs", "the graph batch sizes are chosen up to --cuda-graph-max-bs; a list is not supported"),
    ("--quantization", "the checkpoint's own quantization (block-FP8 in config.json) is used; converting at load "
                       "is not supported (CPU experts: --kt-method)"),
    ("--speculative-algorithm", "speculative decoding is not built"),
    ("--speculative-draft-model-path", "speculative decoding is not built"),
    ("--enable-dp-attention", "data-parallel attention needs several GPUs; hybridmoe runs on one"),
    ("--is-embedding", "embedding models are not served: hybridmoe serves generative MoE models"),
    ("--enable-hierarchical-cache", "the KV cache lives on the GPU only (no host-memory tier)"),
    ("--json-model-override-args", "the model's config.json is used as it is"),
    ("--dist-init-addr", "multi-node serving is not built: one host per server"),
    ("--moe-a2a-backend", "expert parallelism across GPUs is not built (--kt-num-gpu-experts splits GPU/CPU)"),
    ("--enable-eplb", "expert load balancing across GPUs is not built; --kt-enable-dynamic-expert-update moves "
                      "hot experts to the GPU"),
)


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """The flags of this module, in two groups of --help."""
    g = p.add_argument_group("SGLang compatibility (accepted; single-device values only)")
    for flags, default, reason in SINGLE_DEVICE_FLAGS:
        g.add_argument(*flags, dest=flags[0].lstrip("-").replace("-", "_"), type=int, default=default,
                       help=f"only {default} is supported: {reason}")
    for flag, reason in NO_OP_FLAGS:
        g.add_argument(flag, action="store_true", help=reason)
    r = p.add_argument_group("SGLang flags that are refused (the server does not start; the message says why)")
    for flag, reason in REFUSED_FLAGS:
        r.add_argument(flag, nargs="*", default=argparse.SUPPRESS, metavar="VALUE", help=f"refused: {reason}")


def refused(ns: argparse.Namespace) -> list[str]:
    """One line per flag given that is refused: 'FLAG: reason'."""
    bad = []
    for flags, default, reason in SINGLE_DEVICE_FLAGS:
        value = getattr(ns, flags[0].lstrip("-").replace("-", "_"), default)
        if value != default:
            bad.append(f"{flags[0]} {value}: only {default} is supported; {reason}")
    for flag, reason in REFUSED_FLAGS:
        if hasattr(ns, flag.lstrip("-").replace("-", "_")):
            bad.append(f"{flag}: {reason}; remove the flag")
    return bad
