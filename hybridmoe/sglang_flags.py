"""The catalogue of SGLang's `launch_server` flags (and KTransformers' `--kt-*` flags) and what hybridmoe
does with each: data only; sglang_compat.py turns it into parser arguments and startup checks.

Where the names come from (the value forms too: read off each version's own argparse parser):
  - sglang 0.5.23 (the PyPI wheel, the newest release): every option of `ServerArgs.add_cli_args`
    (531 flags, 559 spellings);
  - flags that release dropped, still on older command lines: sglang 0.5.5.post3 and 0.4.10.post2 (the same);
  - KTransformers' SGLang fork ("sglang-kt", github.com/springrain/sglang at 0195b24d7ab0): its kt-* flags
    and the few others it adds; and the kt-* options of its kt_hook.py at 68fe9e9cb3de (--kt-num-gpu-layers,
    --kt-prefill-stream-top-n, --kt-expert-gpu-slots, --kt-layer-h2d-slots, --kt-layer-h2d-batch-size);
  - KTransformers' older kt-sglang names, --kt-amx-weight-path and --kt-amx-method (sglang's server_args
    before the rename): the same flags as --kt-weight-path and --kt-method, so they are aliases here.
  - the parser name tables of sglang 0.5.23 (function_call/function_call_parser.py, parser/reasoning_parser.py).

Decisions:
  OURS     hybridmoe has the flag itself (args.py, launch_server.py, server/limits.py): same name and meaning.
  SIZE     a parallelism size: only its single-device value is accepted (the others are refused, saying why).
  VALUE    accepted at the listed values only (what hybridmoe does anyway); any other value is refused.
  NO_OP    accepted and ignored, with one log line at startup: it only tunes logging, warm-up, SGLang kernels
           or backends that hybridmoe replaces with its own, or several-GPU modes that one GPU never uses.
  REFUSED  the server does not start: one line names the flag and says hybridmoe does not implement it
           (exit code 2).

Value forms ("takes"): "0" a switch (no value), "1" one value, "+" one or more, "*" any number, "?" an
optional value. A line of a block below is `SPELLING[|ALIAS...] TAKES`.
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"

OURS, SIZE, VALUE, NO_OP, REFUSED = "ours", "size", "value", "no-op", "refused"


@dataclass(frozen=True)
class SGLangFlag:
    names: tuple[str, ...]  # SGLang's spelling first, then its aliases
    takes: str  # "0" | "1" | "+" | "*" | "?"
    decision: str  # OURS | SIZE | VALUE | NO_OP | REFUSED
    reason: str = ""  # NO_OP: the log line's reason; SIZE/VALUE/REFUSED: why the flag (or value) is refused
    accepted: tuple[str, ...] = ()  # SIZE/VALUE: the values accepted

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def _block(decision: str, reason: str, text: str) -> tuple[SGLangFlag, ...]:
    out = []
    for line in text.strip().splitlines():
        spellings, takes = line.split()
        out.append(SGLangFlag(tuple(spellings.split("|")), takes, decision, reason))
    return tuple(out)


def _value(spellings: str, takes: str, accepted: tuple[str, ...], reason: str) -> SGLangFlag:
    return SGLangFlag(tuple(spellings.split("|")), takes, VALUE, reason, accepted)


# ---- hybridmoe's own flags of the same names ---------------------------------------------------------------
IMPLEMENTED = _block(OURS, "", """
    --config 1
    --sampling-defaults 1
    --preferred-sampling-params 1
    --model-path|--model 1
    --tokenizer-path 1
    --skip-tokenizer-init 0
    --load-format 1
    --trust-remote-code 0
    --context-length 1
    --revision 1
    --download-dir 1
    --served-model-name 1
    --dtype 1
    --kv-cache-dtype 1
    --mem-fraction-static 1
    --max-running-requests 1
    --max-queued-requests 1
    --max-total-tokens 1
    --chunked-prefill-size 1
    --max-prefill-tokens 1
    --schedule-policy 1
    --page-size 1
    --disable-radix-cache 0
    --disable-overlap-schedule 0
    --device 1
    --random-seed 1
    --watchdog-timeout 1
    --host 1
    --port 1
    --api-key 1
    --chat-template 1
    --enable-cache-report 0
    --allow-auto-truncate 0
    --stream-interval 1
    --log-level 1
    --log-requests 0
    --log-requests-level 1
    --enable-metrics 0
    --decode-log-interval 1
    --attention-backend 1
    --grammar-backend 1
    --reasoning-parser 1
    --tool-call-parser 1
    --init-expert-location 1
    --enable-lora 0
    --lora-paths *
    --max-lora-rank 1
    --lora-target-modules *
    --max-loaded-loras 1
    --max-loras-per-batch 1
    --disable-cuda-graph 0
    --cuda-graph-max-bs|--cuda-graph-max-bs-decode 1
    --piecewise-cuda-graph-max-tokens 1
    --disable-piecewise-cuda-graph|--disable-prefill-cuda-graph 0
    --kt-weight-path|--kt-amx-weight-path 1
    --kt-method|--kt-amx-method 1
    --kt-cpuinfer 1
    --kt-threadpool-count 1
    --kt-numa-nodes +
    --kt-num-gpu-experts 1
    --kt-gpu-experts-ratio 1
    --kt-max-deferred-experts-per-token 1
    --kt-gpu-prefill-token-threshold 1
    --kt-enable-dynamic-expert-update 0
    --kt-expert-placement-strategy 1
    --kt-expert-lora-path 1
""")

# ---- parallelism sizes: (spellings, the one value accepted, why) -------------------------------------------
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
    (("--attn-dp-size", "--attention-data-parallel-size"), 1,
     "data-parallel attention is not built: hybridmoe runs a model on one GPU"),
    (("--attn-cp-size", "--attention-context-parallel-size"), 1,
     "context parallelism is not built: hybridmoe runs a model on one GPU"),
    (("--dcp-size", "--decode-context-parallel-size"), 1,
     "context parallelism is not built: hybridmoe runs a model on one GPU"),
    (("--moe-dp-size", "--moe-data-parallel-size"), 1,
     "data-parallel MoE layers are not built: the routed experts are split between one GPU and the CPU"),
    (("--dwdp-size",), 1, "this parallelism is not built: hybridmoe runs a model on one GPU"),
    (("--moe-dense-tp-size",), 1, "tensor parallelism is not built: hybridmoe runs a model on one GPU"),
    (("--shared-experts-tp-size",), 1, "tensor parallelism is not built: hybridmoe runs a model on one GPU"),
    (("--ep-num-redundant-experts",), 0,
     "redundant experts need expert parallelism across GPUs, which is not built (--kt-num-gpu-experts splits the "
     "experts between the GPU and the CPU)"),
)
SIZES = tuple(SGLangFlag(names, "1", SIZE, reason, (str(one),)) for names, one, reason in SINGLE_DEVICE_FLAGS)

# ---- accepted at these values only --------------------------------------------------------------------------
_OFFLOAD = ("SGLang's weight offloading is not implemented: routed experts run on the CPU with "
            "--kt-num-gpu-experts (or --kt-gpu-experts-ratio)")
_CANARY = "the KV-cache canary is not implemented"
_RECORDER = ("hybridmoe's expert-distribution record (/start_expert_distribution_record, "
             "--record-expert-distribution) counts each layer's expert activations over the whole record")
VALUES: tuple[SGLangFlag, ...] = (
    _value("--tokenizer-mode", "1", ("auto",), "hybridmoe loads the fast tokenizer; slow tokenizers are not "
                                               "supported"),
    _value("--tokenizer-backend", "1", ("huggingface",), "tokenizers are loaded with Hugging Face transformers"),
    _value("--model-impl", "1", ("auto", "sglang"), "hybridmoe runs its own model code"),
    _value("--model-config-parser", "1", ("auto", "hf"), "the model's config.json is read with transformers"),
    _value("--model-loader-extra-config", "1", ("{}",), "hybridmoe's weight loader takes no extra configuration"),
    _value("--moe-a2a-backend", "1", ("none",),
           "expert parallelism across GPUs is not built (--kt-num-gpu-experts splits GPU/CPU)"),
    _value("--disaggregation-mode", "1", ("null",), "prefill/decode disaggregation is not implemented"),
    _value("--base-gpu-id", "1", ("0",), "the server runs on the first visible GPU: choose it with "
                                         "CUDA_VISIBLE_DEVICES"),
    _value("--gpu-id-step", "1", ("1",), "the server runs on one GPU"),
    _value("--cpu-offload-gb", "1", ("0",), _OFFLOAD),
    _value("--offload-group-size", "1", ("-1",), _OFFLOAD),
    _value("--offload-num-in-group", "1", ("1",), _OFFLOAD),
    _value("--offload-prefetch-step", "1", ("1",), _OFFLOAD),
    _value("--offload-mode", "1", ("cpu",), _OFFLOAD),
    _value("--num-continuous-decode-steps", "1", ("1",), "the scheduler runs one decode step per iteration"),
    _value("--schedule-conservativeness", "1", ("1",), "hybridmoe's admission control has no such setting"),
    _value("--radix-eviction-policy", "1", ("lru",),
           "the prefix cache evicts the least recently used pages (leaves first); no other policy is implemented"),
    _value("--lora-eviction-policy", "1", ("lru",),
           "adapters are evicted least recently used first; no other policy is implemented"),
    _value("--lora-drain-wait-threshold", "1", ("0",), "draining adapters for waiting requests is not implemented"),
    _value("--expert-distribution-recorder-mode", "1", ("stat",), _RECORDER + " (stat)"),
    _value("--expert-distribution-recorder-buffer-size", "1", ("-1",), _RECORDER + " (no ring buffer)"),
    _value("--expert-balancedness-report-mode", "1", ("off",), "expert balancedness reports are not implemented"),
    _value("--kv-canary", "1", ("none",), _CANARY),
    _value("--kv-canary-sweep-interval", "1", ("0",), _CANARY),
    _value("--kv-canary-real-data", "1", ("none",), _CANARY),
    _value("--qsa-indexer-dtype", "1", ("auto",), "DeepSeek sparse-attention models are not served"),
    _value("--prefill-kv-cache-dequant-dtype", "1", ("auto",), "the KV cache is read in its own dtype"),
    _value("--c128-page-size", "1", ("16",), "DeepSeek-V4 models are not served"),
    _value("--weight-version", "1", ("default",), "updating weights at run time is not implemented"),
    _value("--weight-cache-mode", "1", ("off",), "the weight-cache daemon is not implemented"),
    _value("--sampling-mask-max-tokens", "1", ("4096",), "returning sampling masks is not implemented"),
    _value("--piecewise-cuda-graph-compiler", "1", ("eager",),
           "prefill CUDA graphs are captured from hybridmoe's eager forward; no compiler is used"),
)

# ---- accepted, no effect (a log line says so) ---------------------------------------------------------------
_MULTI_GPU = ("accepted, no effect: it tunes how several GPUs share a model or talk to each other; hybridmoe runs "
              "a model on one GPU")
_KERNELS = ("accepted, no effect: it picks one of SGLang's kernels or backends; hybridmoe runs its own "
            "(--attention-backend, --moe-backend, --kt-method choose them)")
_PROCESSES = ("accepted, no effect: it tunes SGLang's worker processes, polling or loader I/O, not what is "
              "computed; hybridmoe's own are --tokenizer-workers and its loader")
_LOGGING = ("accepted, no effect: it only tunes SGLang's logging; hybridmoe's is set by --log-level, "
            "--log-requests and --decode-log-interval")
_TURNS_OFF = "accepted, no effect: it turns off something hybridmoe does not have"
NO_OPS: tuple[SGLangFlag, ...] = (
    *_block(NO_OP, "accepted; always on here: the scheduler puts prefill chunks and decode tokens in one batch",
            "--enable-mixed-chunk 0"),
    *_block(NO_OP, "accepted, no effect: one GPU per server, no peer-to-peer access to check", "--enable-p2p-check 0"),
    *_block(NO_OP, "accepted; always so here: shared experts run as their own GPU MLP, never fused into the routed "
                   "experts' kernel", "--disable-shared-experts-fusion 0"),
    *_block(NO_OP, "accepted, no effect: one GPU per server, no all-reduce", "--disable-custom-all-reduce 0"),
    *_block(NO_OP, "accepted; on by default here: prompt batches up to --cuda-graph-max-prefill-tokens replay "
                   "whole-model graphs", """
        --enable-piecewise-cuda-graph 0
        --enable-breakable-cuda-graph 0
    """),
    *_block(NO_OP, "accepted, no effect: prefill graphs run wherever they can; where they cannot (CPU experts, LoRA, "
                   "MLA) a log line says why", "--enforce-piecewise-cuda-graph 0"),
    *_block(NO_OP, "accepted, no effect: hybridmoe sends no warm-up request at startup (kernels and CUDA graphs are "
                   "prepared while the model loads)", """
        --skip-server-warmup 0
        --warmups 1
    """),
    *_block(NO_OP, _LOGGING, """
        --log-level-http 1
        --log-requests-format 1
        --uvicorn-access-log-exclude-prefixes *
        --show-time-cost 0
        --enable-request-time-stats-logging 0
        --gc-warning-threshold-secs 1
        --soft-watchdog-timeout 1
    """),
    *_block(NO_OP, "accepted, no effect: it only shapes SGLang's Prometheus histograms; hybridmoe's /metrics "
                   "(--enable-metrics) uses fixed buckets", """
        --bucket-time-to-first-token +
        --bucket-inter-token-latency +
        --bucket-e2e-request-latency +
        --prompt-tokens-buckets +
        --generation-tokens-buckets +
    """),
    *_block(NO_OP, "accepted, no effect: there is one scheduler here, whose metrics --enable-metrics exports",
            "--enable-metrics-for-all-schedulers 0"),
    *_block(NO_OP, "accepted, no effect: the engine already sleeps while it has no work", "--sleep-on-idle 0"),
    *_block(NO_OP, "accepted, no effect: the MLA chunked prefix-cache path is SGLang's; hybridmoe has none to turn "
                   "off", "--disable-chunked-prefix-cache 0"),
    *_block(NO_OP, "accepted, no effect: float32 matmuls never use TF32 here", "--no-enable-tf32-matmul 0"),
    *_block(NO_OP, "accepted, no effect: hybridmoe loads text-only models, with no multimodal encoder to skip",
            "--language-model-only 0"),
    *_block(NO_OP, "accepted; always so here: an adapter key that is not a LoRA weight, or a missing lora_A/lora_B "
                   "half, is an error", "--lora-strict-loading 0"),
    *_block(NO_OP, "accepted, no effect: outlines is not used (structured output runs on xgrammar)",
            "--disable-outlines-disk-cache 0"),
    *_block(NO_OP, "accepted, no effect: the MLX sampler is for Apple silicon", "--mlx-enable-sampling 0"),
    *_block(NO_OP, "accepted, no effect: profiling and debug output of SGLang's CUDA graphs and layers", """
        --enable-profile-cuda-graph 0
        --debug-cuda-graph 0
        --enable-layerwise-nvtx-marker 0
    """),
    *_block(NO_OP, _TURNS_OFF, """
        --disable-hybrid-swa-memory 0
        --no-enable-decoder-swa-bounded-replay 0
        --no-ple-offload-embedding 0
        --no-dllm-fdfo 0
        --no-mm-enable-dp-encoder 0
        --no-speculative-enable-w4a4-mxfp4-megamoe 0
    """),
    *_block(NO_OP, _PROCESSES, """
        --tokenizer-worker-num 1
        --detokenizer-worker-num 1
        --enable-dynamic-batch-tokenizer 0
        --dynamic-batch-tokenizer-batch-size 1
        --dynamic-batch-tokenizer-batch-timeout 1
        --enable-tokenizer-batch-encode 0
        --disable-tokenizer-batch-decode 0
        --batch-notify-size 1
        --scheduler-recv-interval 1
        --load-snapshot-publish-interval 1
        --gc-threshold +
        --enable-cudagraph-gc 0
        --enable-http-worker-reuseport 0
        --startup-weight-load-mode 1
        --weight-loader-disable-mmap 0
        --weight-loader-prefetch-checkpoints 0
        --weight-loader-prefetch-num-threads 1
        --weight-loader-drop-cache-after-load 0
        --enable-lora-overlap-loading 0
    """),
    *_block(NO_OP, _KERNELS, """
        --sampling-backend 1
        --prefill-attention-backend 1
        --decode-attention-backend 1
        --enable-lean-attention 0
        --fp8-gemm-backend 1
        --fp4-gemm-backend 1
        --bf16-gemm-backend 1
        --moe-runner-backend 1
        --flashinfer-mxfp4-moe-precision 1
        --enable-flashinfer-cutlass-moe 0
        --enable-flashinfer-trtllm-moe 0
        --enable-triton-kernel-moe 0
        --enable-nvidia-megakernel 0
        --enable-amd-monokernel 0
        --monokernel-backend 1
        --max-lora-chunk-size 1
        --triton-attention-reduce-in-fp32 0
        --triton-attention-num-kv-splits 1
        --triton-attention-split-tile-size 1
        --flashinfer-mla-disable-ragged 0
        --enable-fused-qk-norm-rope 0
        --no-enable-fused-qk-norm-rope 0
        --disable-flashinfer-autotune 0
        --flashinfer-autotune-skip-ops +
        --dsa-prefill-backend 1
        --dsa-decode-backend 1
        --nsa-prefill-backend 1
        --nsa-decode-backend 1
        --dsa-paged-mqa-logits-backend 1
        --dsa-topk-backend 1
        --dsa-triton-union 1
        --enable-dsa-fused-indexer 0
        --no-enable-dsa-fused-indexer 0
        --dsv4-prefill-backend 1
        --dsv4-attn-backend 1
        --mamba-backend 1
        --linear-attn-backend 1
        --linear-attn-decode-backend 1
        --linear-attn-prefill-backend 1
        --linear-attn-verify-backend 1
    """),
    *_block(NO_OP, _MULTI_GPU, """
        --nccl-port 1
        --dist-timeout 1
        --pp-max-micro-batch-size 1
        --pp-async-batch-depth 1
        --max-micro-batch-size 1
        --enable-dynamic-chunking 0
        --load-balance-method 1
        --load-watch-interval 1
        --prefill-round-robin-balance 0
        --dcp-comm-backend 1
        --dcp-replicate-q-proj 0
        --no-dcp-replicate-q-proj 0
        --cp-strategy 1
        --prefill-cp-mode 1
        --dsa-prefill-cp-mode 1
        --nsa-prefill-cp-mode 1
        --enable-cp-decode-attn-tp 0
        --enable-dsa-cache-layer-split 0
        --enable-kv-cache-sharding 0
        --enable-dp-attention-local-control-broadcast 0
        --enable-dp-lm-head 0
        --enable-tp-lm-head-all-to-all 0
        --no-enable-tp-lm-head-all-to-all 0
        --enable-attn-tp-input-scattered 0
        --enable-shared-experts-attn-tp 0
        --enable-dense-mlp-attn-tp 0
        --enable-layernorm-sp 0
        --disable-attn-tp-gather 0
        --enable-nccl-nvls 0
        --enable-symm-mem 0
        --enable-mscclpp 0
        --enable-torch-symm-mem 0
        --enable-scattered-sconv 0
        --pre-warm-nccl 0
        --boundary-reduction 1
        --enable-quant-communications 0
        --enable-flashinfer-allreduce-fusion 0
        --enforce-disable-flashinfer-allreduce-fusion 0
        --flashinfer-allreduce-fusion-backend 1
        --enable-aiter-allreduce-fusion 0
        --disable-aiter-allreduce-fusion-in-prefill 0
        --disable-aiter-allreduce-fusion-in-decode 0
        --enable-fused-moe-sum-all-reduce 0
        --enable-megamoe-for-layernorm-sp 0
        --deepep-mode 1
        --deepep-v2-mode 1
        --fuseep-mode 1
        --deepep-dispatcher-output-dtype 1
        --deepep-config 1
        --flashinfer-a2a-dispatch-type 1
        --disable-flashinfer-cutlass-moe-fp4-allgather 0
        --ep-dispatch-algorithm 1
        --eplb-algorithm 1
        --eplb-rebalance-num-iterations 1
        --eplb-rebalance-layers-per-chunk 1
        --eplb-min-rebalancing-utilization-threshold 1
        --enable-two-batch-overlap 0
        --enable-single-batch-overlap 0
        --tbo-token-distribution-threshold 1
    """),
)

# ---- refused ------------------------------------------------------------------------------------------------
_SPEC = "speculative decoding is not built"
_TORCH_COMPILE = ("torch.compile is not used: decode runs in CUDA graphs of Triton kernels (--disable-cuda-graph "
                  "turns them off)")
_KV_TIERS = ("KV-cache offload to host memory or storage is not implemented: the KV cache lives on the GPU only "
             "(no host-memory tier)")
_MULTIMODAL = "multimodal input (images, video, audio) is not implemented: hybridmoe serves text-only MoE models"
_HYBRID_MODELS = ("Mamba, linear-attention and sliding-window models are not served, nor their memory pools and "
                  "kernels' settings")
_DISAGG = "prefill/decode (and encoder) disaggregation is not implemented: one server does prefill and decode"
_QUANT = ("quantizing at load is not implemented: the checkpoint's own quantization is used (CPU experts: "
          "--kt-method)")
_SCHED = ("this scheduling option is not implemented: hybridmoe's scheduler admits waiting requests by "
          "--schedule-policy and batches prefill chunks with decode tokens (--chunked-prefill-size)")
_KT_PLACEMENT = ("this KTransformers option is not implemented: GPU experts are placed per layer by "
                 "--kt-num-gpu-experts or --kt-gpu-experts-ratio and --kt-expert-placement-strategy")
_CUDA_GRAPH = ("this CUDA-graph option is not implemented: decode graphs are captured up to --cuda-graph-max-bs, "
               "prefill graphs up to --cuda-graph-max-prefill-tokens; --disable-cuda-graph turns every graph off, "
               "--disable-prefill-cuda-graph the prefill ones")
REFUSALS: tuple[SGLangFlag, ...] = (
    # the first refusals (their reasons are shown as they were)
    *_block(REFUSED, "the LoRA kernels are hybridmoe's own (Triton on CUDA, torch on the CPU); leave it out",
            "--lora-backend 1"),
    *_block(REFUSED, "give the non-expert half as --lora-paths and the expert half as --kt-expert-lora-path",
            "--kt-lora-path 1"),
    *_block(REFUSED, _TORCH_COMPILE, """
        --enable-torch-compile 0
        --enable-torch-compile-debug-mode 0
    """),
    *_block(REFUSED, "torch.compile is not used: decode runs in CUDA graphs (--cuda-graph-max-bs)",
            "--torch-compile-max-bs 1"),
    *_block(REFUSED, "the graph batch sizes are chosen up to --cuda-graph-max-bs; a list is not supported",
            "--cuda-graph-bs +"),
    *_block(REFUSED, _QUANT, """
        --quantization 1
        --torchao-config 1
        --modelopt-quant 1
        --modelopt-checkpoint-restore-path 1
        --modelopt-checkpoint-save-path 1
        --modelopt-export-path 1
        --quantize-and-serve 0
        --rl-quant-profile 1
        --enable-w4a4-mxfp4-megamoe 0
    """),
    *_block(REFUSED, _SPEC, """
        --speculative-algorithm 1
        --speculative-draft-model-path|--speculative-draft-model 1
        --speculative-draft-model-revision 1
        --speculative-draft-load-format 1
        --speculative-num-steps 1
        --speculative-eagle-topk 1
        --speculative-num-draft-tokens 1
        --speculative-dflash-block-size 1
        --speculative-dflash-draft-window-size 1
        --speculative-dspark-block-size 1
        --speculative-dspark-sps-table-path 1
        --speculative-dspark-confidence-sts-path 1
        --speculative-dspark-align-verify-tokens-to-graph-tier 0
        --speculative-accept-threshold-single 1
        --speculative-accept-threshold-acc 1
        --speculative-use-rejection-sampling 0
        --speculative-token-map 1
        --speculative-attention-mode 1
        --speculative-draft-attention-backend 1
        --speculative-dsa-topk-backend 1
        --speculative-draft-kv-cache-dtype 1
        --speculative-draft-window-size 1
        --speculative-moe-runner-backend 1
        --speculative-moe-a2a-backend 1
        --speculative-enable-w4a4-mxfp4-megamoe 0
        --speculative-draft-model-quantization 1
        --speculative-adaptive 0
        --speculative-adaptive-config 1
        --speculative-ngram-min-bfs-breadth 1
        --speculative-ngram-max-bfs-breadth 1
        --speculative-ngram-match-type 1
        --speculative-ngram-max-trie-depth 1
        --speculative-ngram-capacity 1
        --speculative-ngram-external-corpus-path 1
        --speculative-ngram-external-sam-budget 1
        --speculative-ngram-external-corpus-max-tokens 1
        --speculative-ngram-min-match-window-size 1
        --speculative-ngram-max-match-window-size 1
        --speculative-ngram-branch-length 1
        --speculative-domino-candidate-pool-size 1
        --speculative-use-block-verification 0
        --speculative-draft-sink-size 1
        --speculative-skip-dp-mlp-sync 0
        --enable-multi-layer-eagle 0
        --uno-lora-path 1
        --decoupled-spec-bind-endpoint 1
        --decoupled-spec-connect-endpoints 1
        --decoupled-spec-rank 1
        --decoupled-spec-role 1
        --spec-trace-dir 1
        --enable-draft-weights-cpu-backup 0
        --decrypted-draft-config-file 1
    """),
    *_block(REFUSED, "data-parallel attention needs several GPUs; hybridmoe runs on one", "--enable-dp-attention 0"),
    *_block(REFUSED, "context parallelism needs several GPUs; hybridmoe runs on one", """
        --enable-prefill-cp 0
        --enable-prefill-context-parallel 0
        --enable-dsa-prefill-context-parallel 0
        --enable-nsa-prefill-context-parallel 0
    """),
    *_block(REFUSED, "embedding models are not served: hybridmoe serves generative MoE models", """
        --is-embedding 0
        --prefill-only-disable-kv-cache 0
    """),
    *_block(REFUSED, _KV_TIERS, """
        --enable-hierarchical-cache|--enable-hicache 0
        --hicache-ratio 1
        --hicache-size 1
        --hicache-host-memory-mode 1
        --hicache-host-memory-fraction 1
        --hicache-write-policy 1
        --hicache-io-backend 1
        --hicache-mem-layout 1
        --hicache-storage-backend 1
        --hicache-storage-prefetch-policy 1
        --hicache-storage-backend-extra-config 1
        --hicache-storage-prefetch-retry-poll-interval 1
        --hicache-storage-prefetch-retry-max-attempts 1
        --enable-lmcache 0
        --lmcache-config-file 1
        --enable-flexkv 0
        --flexkv-config-file 1
        --enable-unified-cache-external-linker 0
        --unified-cache-external-linker-backend 1
        --unified-cache-external-linker-config 1
        --enable-linker-mla-dedup 0
    """),
    *_block(REFUSED, "the model's config.json is used as it is", "--json-model-override-args 1"),
    *_block(REFUSED, "multi-node serving is not built: one host per server", """
        --dist-init-addr|--nccl-init-addr 1
        --use-ray 0
        --gated-launch-port 1
    """),
    *_block(REFUSED, "expert parallelism across GPUs is not built (--kt-num-gpu-experts splits GPU/CPU)", """
        --enable-ep-moe 0
        --enable-deepep-moe 0
    """),
    *_block(REFUSED, "expert load balancing across GPUs is not built; --kt-enable-dynamic-expert-update moves hot "
                     "experts to the GPU", "--enable-eplb 0"),
    *_block(REFUSED, "elastic expert parallelism is not built: hybridmoe runs a model on one GPU", """
        --elastic-ep-backend 1
        --enable-elastic-expert-backup 0
        --mooncake-ib-device 1
        --enable-waterfill 0
        --elastic-ep-join-mode 1
        --elastic-ep-join-rank-offset 1
        --elastic-ep-initial-size 1
        --max-ep-size 1
        --elastic-ep-scale-timeout 1
        --elastic-ep-rejoin 0
    """),
    *_block(REFUSED, "shared experts always run as their own GPU MLP here; fusing them into the routed experts' "
                     "kernel is not implemented", "--enforce-shared-experts-fusion 0"),
    *_block(REFUSED, "SGLang's paged experts are not implemented: --kt-num-gpu-experts keeps that many routed experts "
                     "per layer on the GPU and runs the others on the CPU", """
        --enable-paged-experts 0
        --paged-experts-num-resident 1
    """),
    *_block(REFUSED, _KT_PLACEMENT, """
        --kt-num-gpu-layers 1
        --kt-prefill-stream-top-n 1
        --kt-expert-gpu-slots 1
        --kt-layer-h2d-slots 1
        --kt-layer-h2d-batch-size 1
    """),
    *_block(REFUSED, "recording the KT GPU experts' masks is not implemented: --record-expert-distribution records "
                     "the routed experts' activations", "--record-kt-gpu-expert-distribution 0"),
    *_block(REFUSED, "MoE LoRA with shared outer matrices or virtual experts is not implemented: expert LoRA weights "
                     "are per expert here", """
        --experts-shared-outer-loras 0
        --no-experts-shared-outer-loras 0
        --lora-use-virtual-experts 0
    """),
    *_block(REFUSED, "lenient adapter loading is not implemented: an adapter key that is not a LoRA weight, or a "
                     "missing lora_A/lora_B half, is an error", "--no-lora-strict-loading 0"),
    *_block(REFUSED, _SCHED, """
        --prefill-decode-interval 1
        --prefill-decode-interval-min-bs 1
        --prefill-max-requests 1
        --min-free-slots-delay 1
        --retraction-policy 1
        --enable-prefill-delayer 0
        --prefill-delayer-max-delay-passes 1
        --prefill-delayer-token-usage-low-watermark 1
        --prefill-delayer-forward-passes-buckets +
        --prefill-delayer-wait-seconds-buckets +
        --prefill-delayer-queue-min-ratio 1
        --prefill-delayer-max-delay-ms 1
    """),
    *_block(REFUSED, "priority scheduling is not implemented: waiting requests are ordered by --schedule-policy", """
        --enable-priority-scheduling 0
        --disable-priority-preemption 0
        --default-priority-value 1
        --abort-on-priority-when-disabled 0
        --schedule-low-priority-values-first 0
        --priority-scheduling-preemption-threshold 1
    """),
    *_block(REFUSED, "custom radix-eviction and radix-cache backends are not implemented: the prefix cache evicts the "
                     "least recently used pages", """
        --radix-eviction-policy-config 1
        --radix-cache-backend 1
    """),
    *_block(REFUSED, _HYBRID_MODELS, """
        --enable-unified-memory 0
        --enable-page-major-kv-layout 0
        --hybrid-kvcache-ratio ?
        --swa-full-tokens-ratio 1
        --swa-prefix-tails 1
        --enable-encoder-swa-bounded-replay 0
        --enable-decoder-swa-bounded-replay 0
        --max-mamba-cache-size 1
        --mamba-ssm-dtype 1
        --mamba-max-states-per-path 1
        --enable-mamba-cache-stochastic-rounding 0
        --mamba-cache-philox-rounds 1
        --mamba-full-memory-ratio 1
        --mamba-radix-cache-strategy 1
        --mamba-scheduler-strategy 1
        --mamba-track-interval 1
        --enable-int8-mamba-checkpoint 0
        --int8-mamba-ckpt-size 1
        --enable-linear-replayssm 0
        --linear-replayssm-cache-len 1
        --enable-linear-replayssm-spec 0
        --enable-gdn-replayssm-spec 0
    """),
    *_block(REFUSED, "DeepSeek sparse-attention models (V3.2, V4) are not served", """
        --enable-deepseek-v4-fp4-indexer 0
    """),
    *_block(REFUSED, "sparse attention is not implemented: attention reads the whole KV cache", """
        --enable-hisparse 0
        --hisparse-config|--hierarchical-sparse-attention-extra-config 1
        --enable-double-sparsity 0
        --ds-channel-config-path 1
        --ds-heavy-channel-num 1
        --ds-heavy-token-num 1
        --ds-heavy-channel-type 1
        --ds-sparse-decode-threshold 1
    """),
    *_block(REFUSED, _MULTIMODAL, """
        --enable-multimodal 0
        --mm-attention-backend 1
        --enable-precise-embedding-interpolation 0
        --enable-broadcast-mm-inputs-process 0
        --enable-prefix-mm-cache 0
        --mm-enable-dp-encoder 0
        --mm-process-config 1
        --mm-processor-worker-num 1
        --mm-io-worker-num 1
        --allowed-media-domains +
        --media-url-max-file-size-mb 1
        --mm-preprocess-cache-size-mb 1
        --trust-mm-content-hashes 0
        --limit-mm-data-per-request 1
        --enable-mm-global-cache 0
        --image-processor-backend 1
        --mm-global-cache-backend 1
        --disable-fast-image-processor 0
        --mm-feature-transport 1
        --keep-mm-feature-on-device 0
        --mm-max-concurrent-calls 1
        --mm-per-request-timeout 1
        --asr-max-buffer-seconds 1
        --asr-max-concurrent-sessions 1
        --encoder-only 0
        --language-only 0
        --encoder-transfer-backend 1
        --encoder-urls +
        --encoder-bootstrap-port 1
        --encoder-register-urls +
        --enable-adaptive-dispatch-to-encoder 0
    """),
    *_block(REFUSED, _DISAGG, """
        --disaggregation-transfer-backend 1
        --disaggregation-bootstrap-port 1
        --disaggregation-ib-device 1
        --disaggregation-decode-enable-radix-cache 0
        --disaggregation-decode-enable-offload-kvcache 0
        --disaggregation-decode-retraction-backup 1
        --disaggregation-decode-extra-slots 1
        --disaggregation-decode-polling-interval 1
        --disaggregation-decode-host-receive-threshold 1
        --disaggregation-decode-allocation-policy 1
        --disaggregation-enable-kv-checksum 0
        --disaggregation-decode-tp 1
        --disaggregation-decode-dp 1
        --disaggregation-prefill-pp 1
        --num-reserved-decode-tokens 1
        --optimistic-prefill-attempts 1
        --enable-pd-role-switch 0
        --pdlb-url 1
    """),
    *_block(REFUSED, "PD-multiplexing is not implemented", """
        --enable-pdmux 0
        --pdmux-config-path 1
        --sm-group-num 1
    """),
    *_block(REFUSED, "diffusion language models are not served", """
        --dllm-algorithm 1
        --dllm-algorithm-config 1
        --dllm-fdfo 0
    """),
    *_block(REFUSED, "per-layer-embedding offload is not implemented", """
        --ple-offload-embedding 0
        --ple-offload-backend 1
        --ple-offload-dir 1
    """),
    *_block(REFUSED, "an fp32 LM head is not implemented: the LM head runs in --dtype", "--enable-fp32-lm-head 0"),
    *_block(REFUSED, "TF32 matmuls are not used: float32 matmuls keep full precision", "--enable-tf32-matmul 0"),
    *_block(REFUSED, "FP8 KV-cache scales from a file are not implemented: --kv-cache-dtype fp8_e4m3/fp8_e5m2 stores "
                     "K/V unscaled", "--quantization-param-path 1"),
    *_block(REFUSED, "loading weights from another server, a weight cache or a custom loader is not implemented: "
                     "weights are read from --model-path", """
        --remote-instance-weight-loader-seed-instance-ip 1
        --remote-instance-weight-loader-seed-instance-service-port 1
        --remote-instance-weight-loader-send-weights-group-ports 1
        --remote-instance-weight-loader-backend 1
        --remote-instance-weight-loader-start-seed-via-transfer-engine 0
        --engine-info-bootstrap-port 1
        --modelexpress-config 1
        --weight-cache-socket 1
        --weight-cache-timeout 1
        --custom-weight-loader *
    """),
    *_block(REFUSED, "releasing or updating weights at run time (RL training loops) is not implemented", """
        --enable-memory-saver 0
        --enable-weights-cpu-backup 0
        --checkpoint-engine-wait-weights-before-ready 0
        --rl-on-policy-target 1
    """),
    *_block(REFUSED, "verifying the checkpoint against a checksum is not implemented", "--model-checksum ?"),
    *_block(REFUSED, "deleting the checkpoint after loading is not implemented", "--delete-ckpt-after-loading 0"),
    *_block(REFUSED, "encrypted checkpoints are not supported", "--decrypted-config-file 1"),
    *_block(REFUSED, "deterministic (batch-invariant) inference is not implemented", "--enable-deterministic-inference 0"),
    *_block(REFUSED, "debugging dumps and hooks (tensor dumps, crash dumps, forward hooks, NaN detection) are not "
                     "implemented", """
        --debug-tensor-dump-output-folder 1
        --debug-tensor-dump-layers +
        --debug-tensor-dump-input-file 1
        --debug-tensor-dump-inject 1
        --debug-tensor-dump-prefill-only 0
        --msprobe-dump-config 1
        --crash-dump-folder 1
        --forward-hooks 1
        --enable-nan-detection 0
    """),
    *_block(REFUSED, _CUDA_GRAPH, """
        --cuda-graph-config 1
        --cuda-graph-backend-decode 1
        --cuda-graph-backend-prefill 1
        --cuda-graph-max-bs-prefill 1
        --cuda-graph-bs-decode +
        --cuda-graph-bs-prefill +
        --cuda-graph-prefill-max-context|--context-bucket 1
        --cuda-graph-max-seq-len-prefill 1
        --cuda-graph-tc-compiler 1
        --piecewise-cuda-graph-tokens 1
        --disable-decode-cuda-graph 0
        --disable-cuda-graph-padding 0
    """),
    *_block(REFUSED, "gRPC serving is not implemented: hybridmoe speaks HTTP", """
        --grpc-mode 0
        --smg-grpc-mode 0
        --grpc-port 1
        --grpc-response-timeout-secs 1
        --sidecar 1
        --sidecar-args 1
        --smg-http-sidecar-port|--grpc-http-sidecar-port 1
    """),
    *_block(REFUSED, "HTTP/2 is not implemented: the server speaks HTTP/1.1", """
        --enable-http2 0
        --http2-max-concurrent-streams 1
        --http2-initial-connection-window-size 1
    """),
    *_block(REFUSED, "TLS is not implemented: put a TLS-terminating proxy in front of the server", """
        --ssl-keyfile 1
        --ssl-certfile 1
        --ssl-ca-certs 1
        --ssl-keyfile-password 1
        --enable-ssl-refresh 0
    """),
    *_block(REFUSED, "a separate admin key is not implemented: --api-key guards every route but /health",
            "--admin-api-key 1"),
    *_block(REFUSED, "serving under a path prefix is not implemented", "--fastapi-root-path 1"),
    *_block(REFUSED, "this chat-template option is not implemented: --chat-template sets the template, requests "
                     "pass chat_template_kwargs (a client's own template: --allow-client-chat-template)", """
        --trust-request-chat-template 0
        --hf-chat-template-name 1
        --completion-template 1
        --default-chat-template-kwargs 1
    """),
    *_block(REFUSED, "this reasoning option is not implemented: --reasoning-parser splits out the thinking part", """
        --strip-thinking-cache 0
        --enable-strict-thinking 0
    """),
    *_block(REFUSED, "this response option is not implemented: responses carry the fields of SGLang's defaults", """
        --return-input-ids 0
        --return-output-ids 0
        --stream-response-default-include-usage 0
    """),
    *_block(REFUSED, "incremental (disjoint) stream output is not implemented: each /generate stream event carries "
                     "the whole text so far, as SGLang's default", """
        --stream-output 0
        --incremental-streaming-output 0
    """),
    *_block(REFUSED, "streaming sessions are not implemented", """
        --enable-streaming-session 0
        --enable-session-radix-cache 0
    """),
    *_block(REFUSED, "storing Responses is not implemented: /v1/responses stores nothing (previous_response_id is "
                     "refused)", "--enable-response-store 0"),
    *_block(REFUSED, "tool servers (MCP) and the files API are not implemented", """
        --tool-server 1
        --file-storage-path 1
    """),
    *_block(REFUSED, "returning hidden states, routed experts or indexer top-k is not implemented", """
        --enable-return-hidden-states 0
        --return-hidden-states-mode 1
        --enable-return-aux-hidden-states 0
        --return-aux-hidden-state-layer-ids +
        --enable-return-routed-experts 0
        --enable-return-indexer-topk 0
    """),
    *_block(REFUSED, "custom logit processors are not implemented", "--enable-custom-logit-processor 0"),
    *_block(REFUSED, "multi-item scoring is not implemented", """
        --enable-mis 0
        --multi-item-scoring-delimiter 1
    """),
    *_block(REFUSED, "text watermarking is not implemented", """
        --enable-watermark 0
        --watermark-config 1
    """),
    *_block(REFUSED, "this structured-output setting is not implemented: JSON schemas compile with xgrammar's "
                     "defaults", """
        --constrained-json-whitespace-pattern 1
        --constrained-json-disable-any-whitespace 0
        --constrained-json-max-whitespace-cnt 1
    """),
    *_block(REFUSED, "writing request logs elsewhere than the server log is not implemented (--log-requests logs "
                     "them there)", "--log-requests-target +"),
    *_block(REFUSED, "OpenTelemetry tracing is not implemented", """
        --enable-trace 0
        --trace-modules 1
        --otlp-traces-endpoint 1
        --otlp-service-name 1
    """),
    *_block(REFUSED, "this metric or event export is not implemented: hybridmoe's metrics are GET /metrics "
                     "(--enable-metrics)", """
        --enable-mfu-metrics 0
        --collect-tokens-histogram 0
        --enable-expert-distribution-metrics 0
        --tokenizer-metrics-custom-labels-header 1
        --tokenizer-metrics-allowed-custom-labels +
        --extra-metric-labels 1
        --export-metrics-to-file 0
        --export-metrics-to-file-dir 1
        --kv-events-config 1
        --load-publish-endpoint 1
        --enable-forward-pass-metrics 0
        --forward-pass-metrics-worker-id 1
        --forward-pass-metrics-ipc-name 1
    """),
    *_block(REFUSED, "NUMA placement of SGLang's processes is not implemented: --kt-numa-nodes places the CPU "
                     "experts' threads", "--numa-node +"),
)

FLAGS: tuple[SGLangFlag, ...] = (*IMPLEMENTED, *SIZES, *VALUES, *NO_OPS, *REFUSALS)

# ---- SGLang's --tool-call-parser / --reasoning-parser names (sglang 0.5.23) -------------------------------------
SGLANG_TOOL_CALL_PARSERS = (
    "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4", "deepseekv41",
    "dots", "glm", "glm45", "glm47", "gpt-oss", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3", "mimo",
    "minicpm5", "mistral", "muse", "poolside_v1", "pythonic", "qwen", "qwen25", "qwen3_coder", "spark25", "step3",
    "step3p5", "minimax-m2", "minimax-m3", "nanbeige", "trinity", "interns1", "hermes", "hunyuan", "gigachat3",
    "gigachat35", "gemma4", "inkling", "iquest_q1", "response_template")
SGLANG_REASONING_PARSERS = (
    "apertus2509", "beam", "deepseek-r1", "deepseek-v3", "deepseek-v4", "deepseek-v41", "dots", "glm45", "ling3",
    "hunyuan", "gpt-oss", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "mimo", "muse", "poolside_v1", "qwen3",
    "qwen3-thinking", "minimax", "minimax-append-think", "minimax-m3", "nanbeige", "step3", "step3p5", "mistral",
    "nemotron_3", "granite_thinking_parser", "interns1", "gemma4", "inkling", "iquest_q1", "cohere_command4",
    "gigachat35", "response_template")

# SGLang's names whose format one of ours is exactly: name -> ours. Tool calls: SGLang maps `qwen` to the
# same detector as `qwen25`; `hermes` is the same <tool_call>{"name", "arguments"}</tool_call> blocks (a block
# holding a JSON array gives one call per element, as SGLang's does). Reasoning: SGLang's `deepseek-v3`, `glm45`, `dots`,
# `nanbeige`, `interns1`, `mimo`, `poolside_v1` are Qwen3's <think>...</think> (a <tool_call> also ends it; whether
# the output starts inside the thinking part is read from the prompt's end, as for qwen3); `minimax` is
# `qwen3-thinking` (the output starts inside it); `step3`, `step3p5`, `gigachat35` are DeepSeek-R1's.
TOOL_CALL_PARSER_ALIASES = {"qwen": "qwen25", "hermes": "qwen25"}
REASONING_PARSER_ALIASES = {
    "deepseek-v3": "qwen3", "glm45": "qwen3", "dots": "qwen3", "nanbeige": "qwen3", "interns1": "qwen3",
    "mimo": "qwen3", "poolside_v1": "qwen3", "minimax": "qwen3-thinking", "step3": "deepseek-r1",
    "step3p5": "deepseek-r1", "gigachat35": "deepseek-r1"}

GRAMMAR_BACKENDS_SGLANG = ("xgrammar", "outlines", "llguidance", "none")
