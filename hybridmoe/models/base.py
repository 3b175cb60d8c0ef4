"""A decoder-only MoE transformer assembled from layers, parametrized by an `ArchSpec`.

Parameter names equal the Hugging Face checkpoint names (model.layers.N.input_layernorm.weight,
...), so the loader copies tensors by name, with two exceptions: q/k/v are one fused qkv_proj
filled from the three checkpoint tensors (`checkpoint_parts`), and the routed experts' per-expert
tensors are stacked and handed to an MoEExperts backend (see moe/experts.py).

Legend: T tokens, H hidden, V vocabulary, B sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridmoe.layers.attention.layer import Attention, ForwardContext
from hybridmoe.layers.attention.mla import MLAAttention, MLAConfig
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import RotaryEmbedding, rope_params_of
from hybridmoe.moe.layer import SparseMoEBlock
from hybridmoe.moe.routing import RoutingConfig


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one architecture family from another."""

    name: str
    moe_module: str  # attribute name of the MoE block in a layer ("mlp", "block_sparse_moe")
    expert_names: tuple[str, str, str]  # per-expert tensor names: gate, up, down
    gate_name: str = "gate"
    qkv_bias: bool = False
    qk_norm: bool = False
    renormalize: bool = True
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    dense_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts together (DeepSeek: n_shared_experts * moe_intermediate)
    moe_layers: tuple[int, ...] = ()
    shared_name: str = "shared_expert"  # module name of the shared experts' MLP ("shared_experts": DeepSeek)
    shared_gated: bool = True  # the shared output is scaled by sigmoid(shared_expert_gate x) (Qwen2-MoE)
    routing: RoutingConfig | None = None  # None: softmax top-k, renormalized when `renormalize`
    router_fp32: bool = False  # router weight kept and computed in float32 (DeepSeek)
    score_bias: bool = False  # router has e_score_correction_bias (DeepSeek-V3 noaux_tc)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek); None: standard GQA attention

    @property
    def attention(self) -> str:
        """The attention kind: "mla" or "standard"."""
        return "mla" if self.mla is not None else "standard"

    @property
    def rotary_dim(self) -> int | None:
        """Channels the rotary embedding turns (None: the head dim)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else None

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        prefix = f"model.layers.{layer}.{self.moe_module}.experts.{expert}"
        return tuple(f"{prefix}.{n}.weight" for n in self.expert_names)  # type: ignore[return-value]


class DecoderLayer(nn.Module):
    def __init__(self, idx: int, cfg, spec: ArchSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn: Attention | MLAAttention
        if spec.mla is not None:
            scale = spec.mla.qk_head_dim**-0.5 * rotary.params.softmax_mscale()
            self.self_attn = MLAAttention(idx, h, cfg.num_attention_heads, spec.mla, rotary, scale)
        else:
            head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
            self.self_attn = Attention(idx, h, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, rotary,
                                       qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm, rms_eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.is_moe = idx in spec.moe_layers
        if self.is_moe:
            block = SparseMoEBlock(idx, h, spec.num_experts, spec.top_k, spec.moe_intermediate, spec.renormalize,
                                   spec.shared_intermediate, spec.gate_name, routing=spec.routing,
                                   shared_name=spec.shared_name, shared_gated=spec.shared_gated,
                                   router_fp32=spec.router_fp32, score_bias=spec.score_bias)
            self.add_module(spec.moe_module, block)
        else:
            self.mlp = GatedMLP(h, spec.dense_intermediate, cfg.hidden_act)
        self.ffn_name = spec.moe_module if self.is_moe else "mlp"

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it): the residual add is
        fused into the next norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, positions, ctx)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return getattr(self, self.ffn_name)(h), residual


class _Backbone(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, max_position: int) -> None:
        super().__init__()
        dim = spec.rotary_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(dim, max_position, rope_params_of(cfg))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(i, cfg, spec, self.rotary) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoECausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm and LM head."""

    def __init__(self, cfg, spec: ArchSpec, max_position: int) -> None:
        super().__init__()
        self.config, self.spec = cfg, spec
        self.model = _Backbone(cfg, spec, max_position)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, ctx)
        return self.model.norm.add_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # [B, H] -> [B, V]
        """The logits of `hidden`; with `out` ([B, V], the CUDA graphs' shared buffer) written there."""
        if out is None:
            return self.lm_head(hidden)
        head = self.lm_head
        if type(head) is nn.Linear and head.bias is None and out.dtype == hidden.dtype == head.weight.dtype:
            return torch.matmul(hidden, head.weight.t(), out=out)  # F.linear's GEMM, straight into `out`
        return out.copy_(head(hidden))

    def checkpoint_parts(self, name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors that fill parameter `name`: itself, or the parts of a fused one."""
        if ".self_attn.qkv_proj." in name:
            prefix, suffix = name.rsplit(".qkv_proj.", 1)
            layer = self.model.layers[int(name.split(".")[2])]
            return layer.self_attn.checkpoint_parts(prefix, suffix, param)
        return [(name, param)]

    def moe_blocks(self) -> list[SparseMoEBlock]:
        return [getattr(layer, self.spec.moe_module) for layer in self.model.layers if layer.is_moe]
