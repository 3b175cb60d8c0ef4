"""The startup memory plan of a hybrid model: what goes to GPU memory and what stays in host
memory, computed from the config before any weight is read, and the refusal of a plan that does
not fit (with the `--kt-num-gpu-experts` that would).

Legend: L MoE layers, E experts per layer, N GPU experts per layer, H hidden, I expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30

# bytes per expert weight in host memory, per CPU method (scales included, approximately)
_CPU_BYTES_PER_PARAM = {"AMXINT8": 1.0 + 4 / 2048, "AMXINT4": 0.5 + 4 / 64, "BF16": 2.0, "FP8": 1.0 + 4 / (16 * 128)}


@dataclass
class MemoryPlan:
    gpu: dict[str, int] = field(default_factory=dict)  # bytes by item
    host: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        def fmt(side: str, items: dict[str, int]) -> str:
            parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in items.items())
            return f"{side} memory plan (GiB): {parts}; total {sum(items.values()) / GiB:.2f}"

        return [fmt("GPU", self.gpu), fmt("host", self.host)]


def expert_params(hidden: int, inter: int) -> int:
    return 3 * hidden * inter


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
) -> MemoryPlan:
    """Sizes from the config alone. The KV cache item is the minimum the server needs (one full
    context); the runner gives it whatever --mem-fraction-static leaves. With a layerwise prefill
    threshold the GPU also holds the prefill buffers (one layer's streamed experts in the model dtype,
    two staging slots of their packed bytes, the dequantization temporaries); with dynamic expert
    update the host holds every expert of every layer."""
    h, inter = hf_config.hidden_size, spec.moe_intermediate
    per_expert = expert_params(h, inter)
    n_gpu = sum(int(m.sum()) for m in masks.values())
    n_cpu = sum(int((~m).sum()) for m in masks.values())
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    layers = hf_config.num_hidden_layers
    total_params = _dense_params(hf_config, spec, head_dim)
    kv_per_token = 2 * layers * hf_config.num_key_value_heads * head_dim * dtype_bytes
    plan = MemoryPlan()
    plan.gpu["non-expert weights"] = total_params * dtype_bytes
    plan.gpu["GPU experts"] = n_gpu * per_expert * dtype_bytes
    plan.gpu["KV cache (minimum)"] = kv_tokens * kv_per_token
    plan.gpu["activations and graphs"] = 64 * max_batch * h * dtype_bytes * 8 + GiB // 2
    cpu_bytes = _CPU_BYTES_PER_PARAM.get(kt_method, 2.0)
    if dynamic_update:
        n_all = sum(len(m) for m in masks.values())
        plan.host["CPU experts (all of them: dynamic expert update)"] = int(n_all * per_expert * cpu_bytes)
    else:
        plan.host["CPU experts"] = int(n_cpu * per_expert * cpu_bytes)
    if prefill_threshold is not None:
        from hybridmoe.cpu.dequant import DEQUANT_CHUNK_ELEMS

        ec_max = max((int((~m).sum()) for m in masks.values()), default=0)
        temps = min(ec_max * 2 * h * inter, DEQUANT_CHUNK_ELEMS) * (dtype_bytes + 4) if ec_max else 0
        plan.gpu["prefill buffers"] = int(ec_max * per_expert * (dtype_bytes + 2 * cpu_bytes)) + temps
    plan.host["pinned buffers"] = 2 * max(max_batch, 8192) * h * 4 * 2  # in/out, double-buffered
    return plan


def _dense_params(cfg, spec, head_dim: int) -> int:
    """Every weight except the routed experts."""
    h, v = cfg.hidden_size, cfg.vocab_size
    attn = h * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    n = (1 if getattr(cfg, "tie_word_embeddings", False) else 2) * v * h
    for layer in range(cfg.num_hidden_layers):
        n += attn + 2 * h
        if layer in spec.moe_layers:
            n += spec.num_experts * h + 3 * h * spec.shared_intermediate + (h if spec.shared_intermediate else 0)
        else:
            n += 3 * h * spec.dense_intermediate
    return n


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
