"""The startup memory plan of a hybrid model: what goes to GPU memory and what stays in host
memory, computed from the config before any weight is read, and the refusal of a plan that does
not fit (with the `--kt-num-gpu-experts` that would).

Legend: L MoE layers, E experts per layer, N GPU experts per layer, H hidden, I expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30

# bytes per expert weight in host memory, per CPU method (scales included, approximately); FP8: the
# checkpoint's fp8 bytes plus one float32 scale per 16 rows x 128 columns (the CPU engine's packing)
_CPU_BYTES_PER_PARAM = {"AMXINT8": 1.0 + 4 / 2048, "AMXINT4": 0.5 + 4 / 64, "BF16": 2.0, "FP8": 1.0 + 4 / (16 * 128)}


@dataclass
class MemoryPlan:
    gpu: dict[str, int] = field(default_factory=dict)  # bytes by item
    host: dict[str, int] = field(default_factory=dict)
    gpu_expert_bytes: int = 0  # one routed expert in its GPU form (what one more GPU expert per layer costs)

    def lines(self) -> list[str]:
        def fmt(side: str, items: dict[str, int]) -> str:
            parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in items.items())
            return f"{side} memory plan (GiB): {parts}; total {sum(items.values()) / GiB:.2f}"

        return [fmt("GPU", self.gpu), fmt("host", self.host)]


def expert_params(hidden: int, inter: int) -> int:
    return 3 * hidden * inter


def fp8_block(cfg) -> tuple[int, int] | None:
    """[bn, bk] of a block-scaled fp8 checkpoint (quantization_config quant_method fp8), else None."""
    q = getattr(cfg, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    if not q or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


class WeightBytes:
    """Bytes of a linear weight [N, K]: in the model dtype, or fp8 (1 byte) plus a float32 scale per
    block when the checkpoint is block-scaled fp8 and kept so on the GPU."""

    def __init__(self, dtype_bytes: int, block: tuple[int, int] | None, float32_bytes: int = 4) -> None:
        self.dtype_bytes, self.block = dtype_bytes, block
        self.float32_bytes = float32_bytes  # of the float32 parameters (1 with dtype_bytes 1: counts parameters)

    def linear(self, n: int, k: int) -> int:
        if self.block is None:
            return n * k * self.dtype_bytes
        bn, bk = self.block
        return n * k + 4 * (-(-n // bn)) * (-(-k // bk))

    def expert(self, hidden: int, inter: int) -> int:
        """One routed expert: gate and up [I, H], down [H, I]."""
        return 2 * self.linear(inter, hidden) + self.linear(hidden, inter)


def is_mla(cfg) -> bool:
    return bool(getattr(cfg, "kv_lora_rank", None))


def kv_bytes_per_token(cfg, dtype_bytes: int) -> int:
    """KV cache bytes of one token over all layers, by ModelConfig.kv_elements_per_token's rule: MLA
    one latent of kv_lora_rank plus the rope key of qk_rope_head_dim (shared by all heads), else K
    and V of every kv head."""
    if is_mla(cfg):
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_layer = 2 * (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    return cfg.num_hidden_layers * per_layer * dtype_bytes


def attention_shapes(cfg) -> tuple[list[tuple[int, int]], int]:
    """([N, K] of every linear weight of one attention layer, the other (norm) parameters).

    MLA: q_a_proj [q_lora, H] + q_a_layernorm + q_b_proj [heads*(nope+rope), q_lora] (or one q_proj
    [heads*(nope+rope), H] without q_lora_rank), kv_a_proj_with_mqa [kv_lora+rope, H] +
    kv_a_layernorm, kv_b_proj [heads*(nope+v), kv_lora], o_proj [H, heads*v]."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if is_mla(cfg):
        nope, rope, v, kv_lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_lora = getattr(cfg, "q_lora_rank", None)
        q = [(q_lora, h), (heads * (nope + rope), q_lora)] if q_lora else [(heads * (nope + rope), h)]
        return q + [(kv_lora + rope, h), (heads * (nope + v), kv_lora), (h, heads * v)], (q_lora or 0) + kv_lora
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return [(heads * head_dim, h), (kv * head_dim, h), (kv * head_dim, h), (h, heads * head_dim)], 0


def non_expert_bytes(cfg, spec, wb: WeightBytes) -> dict[str, int]:
    """Every weight except the routed experts, by kind: embeddings (and LM head), attention, dense MLPs
    (the first_k_dense_replace layers of DeepSeek), shared experts, routers and norms. Linear weights
    of the decoder layers take `wb`'s form (fp8 + scales for an fp8 checkpoint kept in fp8); the
    embeddings, norms, router gates (and DeepSeek-V3's e_score_correction_bias, float32) stay in the
    model dtype, as the fp8 checkpoints keep them."""
    h, v, dt = cfg.hidden_size, cfg.vocab_size, wb.dtype_bytes
    attn_linears, attn_norms = attention_shapes(cfg)
    attn = sum(wb.linear(n, k) for n, k in attn_linears)
    if is_mla(cfg) and wb.block is not None:
        # kv_b_proj is dequantized to the model dtype at load even in fp8 (weights/fp8_loading.py
        # DENSE_CHILDREN: the absorbed decode reads it as W_UK / W_UV per head)
        n, k = attn_linears[-2]
        attn += n * k * dt - wb.linear(n, k)
    out = {"embeddings": (1 if getattr(cfg, "tie_word_embeddings", False) else 2) * v * h * dt,
           "attention": 0, "dense MLPs": 0, "shared experts": 0, "routers and norms": h * dt}  # the final norm
    shared_gate = hasattr(cfg, "shared_expert_intermediate_size")  # Qwen2-MoE gates its shared expert
    bias = getattr(cfg, "topk_method", None) == "noaux_tc"  # DeepSeek-V3: a selection bias per expert
    si = spec.shared_intermediate
    for layer in range(cfg.num_hidden_layers):
        out["attention"] += attn
        out["routers and norms"] += (2 * h + attn_norms) * dt
        if layer in spec.moe_layers:
            out["routers and norms"] += spec.num_experts * (h * dt + (wb.float32_bytes if bias else 0))
            if si:
                out["shared experts"] += wb.expert(h, si)
                out["routers and norms"] += h * dt if shared_gate else 0
        else:
            out["dense MLPs"] += wb.expert(h, spec.dense_intermediate)
    return out


def prefill_activation_bytes(cfg, spec, dtype_bytes: int) -> int:
    """GPU activation bytes per prompt token of a prefill chunk at its peak, inside one layer: the
    larger of the attention's temporaries (MLA: q, the kv_b_proj output, k, V padded to the q/k head
    dim, the padded attention output, o: layers/attention/mla.py; else q, k, v and the output) and
    the fused MoE's (per token and top-k slot: gate/up, the activation, down's output) or a dense
    MLP's, plus four hidden-size tensors of the residual stream (x, residual, normed, the layer's output)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if is_mla(cfg):
        qk, nope, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        attn = heads * (4 * qk + nope + 2 * v)
    else:
        hd = getattr(cfg, "head_dim", None) or h // heads
        attn = (2 * heads + 2 * (getattr(cfg, "num_key_value_heads", None) or heads)) * hd
    moe = spec.top_k * (3 * spec.moe_intermediate + h)
    dense = 3 * spec.dense_intermediate if len(spec.moe_layers) < cfg.num_hidden_layers else 0
    return (max(attn, moe, dense) + 4 * h) * dtype_bytes


def param_counts(cfg, spec) -> dict[str, int]:
    """Parameter counts: `non-expert`, `routed experts` (all layers), `total`, and `activated` per token
    (the non-expert part, top-k routed experts per MoE layer, one embedding row instead of the table)."""
    ne = sum(non_expert_bytes(cfg, spec, WeightBytes(1, None, float32_bytes=1)).values())
    e = expert_params(cfg.hidden_size, spec.moe_intermediate)
    routed = len(spec.moe_layers) * spec.num_experts * e
    return {"non-expert": ne, "routed experts": routed, "total": ne + routed,
            "activated": ne - (cfg.vocab_size - 1) * cfg.hidden_size + len(spec.moe_layers) * spec.top_k * e}


def batch_activation_bytes(max_batch: int, hidden: int, dtype_bytes: int) -> int:
    """The plan's GPU item "activations and graphs": decode activations and captured graphs of `max_batch`
    rows (--max-running-requests), plus a fixed half GiB."""
    return 64 * max_batch * hidden * dtype_bytes * 8 + GiB // 2


def pinned_buffer_bytes(max_batch: int, hidden: int) -> int:
    """The plan's host item "pinned buffers": a CPU task's float32 inputs and outputs for the larger of a
    decode step of `max_batch` rows and an 8192-token prefill chunk, double-buffered."""
    return 2 * max(max_batch, 8192) * hidden * 4 * 2


def plan_memory(
    hf_config,
    spec,
    masks: dict,  # layer -> [E] bool, True = on the GPU
    dtype_bytes: int,
    kt_method: str,
    kv_tokens: int,
    max_batch: int,
    prefill_threshold: int | None = None,
    dynamic_update: bool = False,
    gpu_fp8: bool | None = None,
    cpu_expert_bytes: dict[int, int] | None = None,
    prefill_tokens: int = 0,
) -> MemoryPlan:
    """Sizes from the config alone. The KV cache item is the minimum the server needs (one full
    context); the runner gives it whatever --mem-fraction-static leaves. With a layerwise prefill
    threshold the GPU also holds the prefill buffers (one layer's streamed experts in their GPU form,
    two staging slots of their packed bytes (GGUF blocks: of the layer whose streamed blocks are the
    largest), the dequantization temporaries (none for GGUF blocks)); with dynamic expert
    update the host holds every expert of every layer. prefill_tokens: the largest prefill chunk (its
    activations, prefill_activation_bytes per token).

    gpu_fp8: the GPU keeps a block-scaled fp8 checkpoint's linear weights (and GPU experts) in fp8,
    1 byte per weight plus a float32 scale per block; None: so when the config is fp8 (quant_method
    fp8), False: dequantized to the model dtype at load (GPUs without fp8, or when asked).

    cpu_expert_bytes: layer -> bytes of one of its CPU experts as stored (GGUF blocks, --kt-method
    LLAMAFILE: each layer may have its own types); None: the method's bytes per parameter."""
    h, inter = hf_config.hidden_size, spec.moe_intermediate
    block = fp8_block(hf_config)
    if gpu_fp8 is None:
        gpu_fp8 = block is not None
    wb = WeightBytes(dtype_bytes, block if gpu_fp8 and block is not None else None)
    per_expert = expert_params(h, inter)
    gpu_expert = wb.expert(h, inter)
    n_gpu = sum(int(m.sum()) for m in masks.values())
    n_cpu = sum(int((~m).sum()) for m in masks.values())
    plan = MemoryPlan(gpu_expert_bytes=gpu_expert)
    plan.gpu["non-expert weights"] = sum(non_expert_bytes(hf_config, spec, wb).values())
    plan.gpu["GPU experts"] = n_gpu * gpu_expert
    plan.gpu["KV cache (minimum)"] = kv_tokens * kv_bytes_per_token(hf_config, dtype_bytes)
    plan.gpu["activations and graphs"] = batch_activation_bytes(max_batch, h, dtype_bytes)
    if prefill_tokens:
        plan.gpu["prefill activations"] = prefill_tokens * prefill_activation_bytes(hf_config, spec, dtype_bytes)
    cpu_bytes = _CPU_BYTES_PER_PARAM.get(kt_method, 2.0)
    if cpu_expert_bytes is not None:  # with dynamic expert update the CPU layers hold every expert
        plan.host["CPU experts (GGUF blocks)"] = sum((len(m) if dynamic_update else int((~m).sum()))
                                                     * cpu_expert_bytes[layer] for layer, m in masks.items())
    elif dynamic_update:
        n_all = sum(len(m) for m in masks.values())
        plan.host["CPU experts (all of them: dynamic expert update)"] = int(n_all * per_expert * cpu_bytes)
    else:
        plan.host["CPU experts"] = int(n_cpu * per_expert * cpu_bytes)
    if prefill_threshold is not None and cpu_expert_bytes is not None:
        # GGUF: a staging slot holds the largest layer's streamed blocks (3 tensors, each 256-byte
        # aligned: moe/layerwise.stage_layout); the Triton kernel dequantizes into the buffer directly
        ec_max = max((int((~m).sum()) for m in masks.values()), default=0)
        slot = max((int((~m).sum()) * cpu_expert_bytes[layer] + 3 * 256 for layer, m in masks.items()), default=0)
        plan.gpu["prefill buffers"] = ec_max * per_expert * dtype_bytes + 2 * slot if ec_max else 0
    elif prefill_threshold is not None:
        from hybridmoe.cpu.dequant import DEQUANT_CHUNK_ELEMS

        ec_max = max((int((~m).sum()) for m in masks.values()), default=0)
        # FP8 CPU experts streamed to fp8 GPU experts are copied as they are: no dequantization
        dequant = ec_max and not (kt_method == "FP8" and wb.block is not None)
        temps = min(ec_max * 2 * h * inter, DEQUANT_CHUNK_ELEMS) * (dtype_bytes + 4) if dequant else 0
        # the buffer holds the streamed experts in the model dtype (dequantized), fp8 only when copied as they are
        buffer_expert = gpu_expert if not dequant else per_expert * dtype_bytes
        plan.gpu["prefill buffers"] = int(ec_max * (buffer_expert + 2 * per_expert * cpu_bytes)) + temps
    plan.host["pinned buffers"] = pinned_buffer_bytes(max_batch, h)  # in/out, double-buffered
    return plan


def check_fits(plan: MemoryPlan, gpu_budget: int | None, host_budget: int | None, per_layer_expert_bytes: int,
               num_moe_layers: int, n_gpu_per_layer: int) -> str | None:
    """None if the plan fits, else the reason with the --kt-num-gpu-experts that would fit."""
    if gpu_budget is not None and sum(plan.gpu.values()) > gpu_budget:
        spare = gpu_budget - (sum(plan.gpu.values()) - plan.gpu["GPU experts"])
        fit = max(0, spare // max(1, per_layer_expert_bytes * num_moe_layers))
        return (f"the plan needs {sum(plan.gpu.values()) / GiB:.1f} GiB of GPU memory, {gpu_budget / GiB:.1f} GiB "
                f"are available (--mem-fraction-static); --kt-num-gpu-experts {min(fit, n_gpu_per_layer)} would fit")
    if host_budget is not None and sum(plan.host.values()) > host_budget:
        return (f"the plan needs {sum(plan.host.values()) / GiB:.1f} GiB of host memory for CPU experts, "
                f"{host_budget / GiB:.1f} GiB are available; use more GPU experts or a smaller --kt-method")
    return None


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
