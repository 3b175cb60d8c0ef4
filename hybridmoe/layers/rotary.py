"""Rotary position embedding (rotate-half layout, as Llama/Qwen/Mixtral checkpoints use), with the
default frequencies or YaRN's (DeepSeek-V2/V3, Kimi-K2, long-context Qwen).

The RoPE settings come from `config.rope_parameters` (transformers 5) or `config.rope_scaling` plus
`config.rope_theta` (4.x); `rope_params_of` reads either and refuses a RoPE type not implemented
here, naming config.json.

Legend: T tokens, H heads, D rotary dim, P positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeParams:
    """The RoPE of a model. For rope_type "yarn": frequencies interpolated between the original
    and the `factor`-scaled ones over the band set by beta_fast/beta_slow, and cos/sin scaled by
    `attention_factor` (the YaRN paper's mscale, from mscale/mscale_all_dim when not given)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_given: float | None = None
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (1 for the default RoPE)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor_given is not None:
            return float(self.attention_factor_given)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """The factor DeepSeek's MLA multiplies its softmax scale by: mscale(factor, mscale_all_dim)^2
        for a scaled RoPE with mscale_all_dim set, else 1 (as the reference implementation)."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(source: str, name: str, value: object, low: float, inclusive: bool = False,
            default: float | None = None) -> float | None:
    """`value` as a float: a finite number above `low` (or equal to it when `inclusive`), None giving
    `default`; else a ValueError naming the field. A NaN, infinite or out-of-range setting made NaN cos/sin
    tables (NaN logits), or a math domain error or ZeroDivisionError deep in the build, naming no field."""
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (value >= low if inclusive else value > low)):
        bound = f"{'>=' if inclusive else '>'} {low:g}"
        raise ValueError(f"{source}: {name} is {value!r}, expected a finite number {bound}")
    return float(value)


def rope_params_of(config: object, source: str = "config.json") -> RopeParams:
    """The RoPE settings of a transformers config of either generation; an unsupported type or
    option, or a value out of range, is an error naming `source` and the field."""
    field = "rope_parameters" if getattr(config, "rope_parameters", None) else "rope_scaling"
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    if any(isinstance(v, dict) for v in params.values()):  # per layer type (sliding/full attention)
        raise ValueError(f"{source}: RoPE parameters per layer type are not supported")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor {partial!r} is not supported (only 1.0)")
    theta = params.get("rope_theta")
    where = f"{field}.rope_theta"
    if theta is None:
        theta, where = getattr(config, "rope_theta", None) or 10000.0, "rope_theta"
    # the base of the frequencies: 1 makes every frequency 1 (and YaRN divides by its log), below 1 inverts them
    theta = _number(source, where, theta, 1.0)
    if rope_type == "default":
        return RopeParams(theta=theta)
    max_pos = getattr(config, "max_position_embeddings", None)
    orig = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                    None) or max_pos
    if orig is not None and (isinstance(orig, bool) or not isinstance(orig, (int, float)) or not math.isfinite(orig)
                             or orig != int(orig) or not 1 <= orig < 2**31):
        raise ValueError(f"{source}: {field}.original_max_position_embeddings is {orig!r}, expected a positive "
                         "integer")
    factor = params.get("factor")
    if factor is None:
        if not (orig and max_pos):
            raise ValueError(f"{source}: yarn RoPE needs factor or original_max_position_embeddings")
        factor = max_pos / orig
    if not (isinstance(factor, (int, float)) and factor > 0) or not orig:
        raise ValueError(f"{source}: yarn RoPE needs a positive factor and original_max_position_embeddings "
                         f"(got factor {factor!r}, original_max_position_embeddings {orig!r})")
    n = f"{field}."
    return RopeParams(rope_type="yarn", theta=theta, factor=_number(source, n + "factor", factor, 0.0),
                      original_max_position=int(orig),
                      # 0 or unset: the default band (as before)
                      beta_fast=_number(source, n + "beta_fast", params.get("beta_fast") or None, 0.0, default=32.0),
                      beta_slow=_number(source, n + "beta_slow", params.get("beta_slow") or None, 0.0, default=1.0),
                      # 0 or unset: no temperature term; a negative one can make the attention factor's divisor 0
                      mscale=_number(source, n + "mscale", params.get("mscale"), 0.0, inclusive=True),
                      mscale_all_dim=_number(source, n + "mscale_all_dim", params.get("mscale_all_dim"), 0.0,
                                             inclusive=True),
                      attention_factor_given=_number(source, n + "attention_factor", params.get("attention_factor"),
                                                     0.0),
                      truncate=bool(params.get("truncate", True)))


def rope_theta_of(config: object) -> float:
    """rope_theta from a transformers config of either generation (4.x field or 5.x rope_parameters)."""
    return rope_params_of(config).theta


def inv_frequencies(dim: int, p: RopeParams, device: torch.device | str | None = None) -> torch.Tensor:  # [D/2]
    """The rotation frequency of each channel pair, float32 as the reference implementations."""
    base = p.theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if p.rope_type != "yarn":
        return inv

    def correction_dim(rotations: float) -> float:  # the channel whose wavelength fits `rotations` times
        return dim * math.log(p.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (high-frequency channels), 0: interpolated by `factor`
    return (inv / p.factor) * (1 - keep) + inv * keep


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_position, D/2] (float32, times the YaRN attention factor);
    layers/fused_ops.py applies them."""

    def __init__(self, head_dim: int, max_position: int, theta: float | RopeParams) -> None:
        super().__init__()
        self.params = theta if isinstance(theta, RopeParams) else RopeParams(theta=float(theta))
        self.head_dim, self.max_position, self.theta = head_dim, max_position, self.params.theta
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build()

    def build(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after the module was created on the meta device."""
        inv_freq = inv_frequencies(self.head_dim, self.params, device)
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        scale = self.params.attention_factor
        if scale == 1.0:
            self.cos, self.sin = freqs.cos(), freqs.sin()
        else:
            self.cos, self.sin = freqs.cos() * scale, freqs.sin() * scale
