"""The types and ranges of the GGUF metadata values this engine computes with, checked before use.

A damaged or hand-edited file may hold a string where a count belongs, a count of 0 or 2**62, a
float for a layer count or an array for a head count; the config mapping (gguf/model_config.py,
gguf/deepseek2.py) would fail in int()'s words naming neither file nor key, divide by zero, or loop
over 2**62 layers. Each such value is a GGUFConfigError naming the file and the key. Only the type
and the plain range are checked here; how the values fit the tensors is model_config's business.

    check_metadata(meta, "qwen3moe", "model.gguf")       # every key below that the file has
    meta_value(meta, "qwen3moe.block_count", POSITIVE, "model.gguf")
"""

from __future__ import annotations

import math
from typing import Any


class GGUFConfigError(ValueError):
    """Metadata that describes no model this engine serves."""


INT_LIMIT = 2**31 - 1  # as config.json's (model_check.py): the model code keeps sizes in int32
POSITIVE, COUNT, POSITIVE_FLOAT, FLOAT, BOOL, TEXT = "positive", "count", "positive_float", "float", "bool", "text"
EXPECTED = {POSITIVE: f"an integer in [1, {INT_LIMIT}]", COUNT: f"an integer in [0, {INT_LIMIT}]",
            POSITIVE_FLOAT: "a finite number > 0", FLOAT: "a finite number", BOOL: "a boolean", TEXT: "a string"}
# {arch}.<suffix> -> kind; a suffix absent from the file is left to the mapping's defaults
ARCH_KEYS = {
    **dict.fromkeys(("block_count", "context_length", "embedding_length", "attention.head_count",
                     "attention.head_count_kv", "expert_used_count"), POSITIVE),
    # 0 is a value some files hold for these (a missing q_lora_rank, the default gating function)
    **dict.fromkeys(("expert_count", "feed_forward_length", "expert_feed_forward_length",
                     "expert_shared_feed_forward_length", "attention.key_length", "attention.value_length",
                     "attention.key_length_mla", "attention.value_length_mla", "attention.kv_lora_rank",
                     "attention.q_lora_rank", "rope.dimension_count", "rope.scaling.original_context_length",
                     "expert_shared_count", "expert_group_count", "expert_group_used_count", "expert_gating_func",
                     "leading_dense_block_count", "nextn_predict_layers"), COUNT),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "rope.freq_base"), POSITIVE_FLOAT),  # 0: NaN outputs
    **dict.fromkeys(("rope.scaling.factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                     "rope.scaling.yarn_log_multiplier", "expert_weights_scale"), FLOAT),
    "expert_weights_norm": BOOL, "rope.scaling.type": TEXT,
}
TOKENIZER_KEYS = {
    **dict.fromkeys(("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                     "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id"), COUNT),
    **dict.fromkeys(("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"), BOOL),
}


def _fits(value: Any, kind: str) -> bool:
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == TEXT:
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind in (POSITIVE, COUNT):
        return isinstance(value, int) and (1 if kind == POSITIVE else 0) <= value <= INT_LIMIT
    return math.isfinite(value) and (kind == FLOAT or value > 0)


TYPE_WORDS = {str: "a string", list: "an array", bool: "a boolean", float: "a float"}


def _shown(value: Any) -> str:
    """The value as the error shows it: its type where that may be the problem, long ones cut short."""
    text = repr(value) if not isinstance(value, list) or len(value) <= 4 else f"[{', '.join(map(repr, value[:4]))}, ...]"
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({TYPE_WORDS[type(value)]})" if type(value) in TYPE_WORDS else text


def meta_value(meta: dict[str, Any], key: str, kind: str, source: str) -> Any:
    """meta[key] (None if absent or undecodable), checked to be of `kind` (GGUFConfigError otherwise)."""
    value = meta.get(key)
    if value is not None and not _fits(value, kind):
        raise GGUFConfigError(f"{source}: metadata {key} is {_shown(value)}, expected {EXPECTED[kind]}: the file is "
                              "damaged or was edited")
    return value


def check_metadata(meta: dict[str, Any], arch: str, source: str) -> None:
    """Every key of ARCH_KEYS (under `arch`) and TOKENIZER_KEYS the file has is of its kind, and the
    special token ids name tokens of the vocabulary."""
    for suffix, kind in ARCH_KEYS.items():
        meta_value(meta, f"{arch}.{suffix}", kind, source)
    for key, kind in TOKENIZER_KEYS.items():
        meta_value(meta, key, kind, source)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return  # no vocabulary (or a damaged one): the tokenizer conversion names that
    for key, kind in TOKENIZER_KEYS.items():
        value = meta.get(key)
        if kind == COUNT and value is not None and value >= len(tokens):
            raise GGUFConfigError(f"{source}: metadata {key} is {value}, but tokenizer.ggml.tokens has {len(tokens)} "
                                  "tokens: the file is damaged or was edited")
