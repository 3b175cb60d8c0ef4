"""llama.cpp on the same random model shape, for bench_cpu_decode.py: a GGUF written with the `gguf`
package (Q8_0 experts, F16 other matrices, F32 norms and router; no tokenizer: tokenizer.ggml.model
"none"), and its batch-1 decode speed through llama-cpp-python's low-level API (`-ngl 0`). The
weights are random (Q8_0 blocks drawn directly), only the shape matters for speed.

Legend: V vocabulary, H hidden, I expert intermediate, E experts, L layers.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def available() -> str:
    """'' when llama-cpp-python and gguf import, else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except Exception as e:  # not installed / not built here
        return f"{type(e).__name__}: {e}"
    return ""


def _tensors(a, dense_q8: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy-order shape, kind) of the Qwen3-MoE GGUF: kind f16 | f32 | q8 (shape in values).
    dense_q8: the attention projections and the output matrix in Q8_0 too (as --cpu-dense-weights int8)."""
    h, q, kv = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    dk = "q8" if dense_q8 else "f16"
    out = [("token_embd.weight", (a.vocab, h), "f16"), ("output_norm.weight", (h,), "f32"),
           ("output.weight", (a.vocab, h), dk)]
    for b in range(a.layers):
        p = f"blk.{b}."
        out += [(p + "attn_norm.weight", (h,), "f32"), (p + "ffn_norm.weight", (h,), "f32"),
                (p + "attn_q.weight", (q, h), dk), (p + "attn_k.weight", (kv, h), dk),
                (p + "attn_v.weight", (kv, h), dk), (p + "attn_output.weight", (h, q), dk),
                (p + "attn_q_norm.weight", (a.head_dim,), "f32"), (p + "attn_k_norm.weight", (a.head_dim,), "f32"),
                (p + "ffn_gate_inp.weight", (a.experts, h), "f32"),
                (p + "ffn_gate_exps.weight", (a.experts, a.inter, h), "q8"),
                (p + "ffn_up_exps.weight", (a.experts, a.inter, h), "q8"),
                (p + "ffn_down_exps.weight", (a.experts, h, a.inter), "q8")]
    return out


def _make(shape: tuple[int, ...], kind: str, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    if kind == "f32" and len(shape) == 1:  # the norms
        return np.ones(shape, dtype=np.float32)
    if kind in ("f16", "f32"):
        x = (rng.random(shape, dtype=np.float32) - 0.5) * np.float32(std * 12 ** 0.5)
        return x.astype(np.float16 if kind == "f16" else np.float32)
    *lead, k = shape  # Q8_0: per 32 values an f16 scale d and 32 int8 codes, w = d * q
    blocks = rng.integers(-127, 128, size=(*lead, k // 32, 34), dtype=np.int8).view(np.uint8)
    d = np.frombuffer(np.float16(std * 3 ** 0.5 / 127).tobytes(), dtype=np.uint8)
    blocks[..., 0], blocks[..., 1] = d[0], d[1]
    return blocks.reshape(*lead, k // 32 * 34)


def write_gguf(path: Path, a, seed: int = 0, dense_q8: bool = False) -> Path:
    """The GGUF of the shape namespace `a` (bench_decode.add_shape_args), one tensor in memory at a time
    (dense_q8: see _tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(6144)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.topk)
    w.add_expert_feed_forward_length(a.inter)
    w.add_vocab_size(a.vocab)
    w.add_tokenizer_model("none")
    specs = _tensors(a, dense_q8)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, shape, kind in specs:
        if kind == "q8":
            nbytes = int(np.prod(shape)) // 32 * 34
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // 32 * 34), np.dtype(np.uint8), nbytes, raw_dtype=q8)
        else:
            dt = np.dtype(np.float16 if kind == "f16" else np.float32)
            w.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shape, kind in specs:
        w.write_tensor_data(_make(shape, kind, rng))
    w.close()
    return path


class LlamaCpp:
    """A llama.cpp context on the GGUF, `threads` threads, everything on the CPU."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024) -> None:
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, user: None)  # kept alive: llama.cpp holds it
        L.llama_log_set(self._quiet, None)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 512, 512
        self.n_ctx = n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")

    def _decode(self, tokens: list[int]) -> None:
        """Feeds the tokens in batches of at most n_batch (512): llama_decode aborts the process on more."""
        if len(tokens) + self.L.llama_memory_seq_pos_max(self.L.llama_get_memory(self.ctx), 0) + 1 > self.n_ctx:
            raise ValueError(f"llama.cpp context of {self.n_ctx} tokens is too small; raise n_ctx")
        for i in range(0, len(tokens), 512):
            part = tokens[i:i + 512]
            arr = (self.L.llama_token * len(part))(*part)
            if self.L.llama_decode(self.ctx, self.L.llama_batch_get_one(arr, len(part))) != 0:
                raise RuntimeError("llama_decode failed")

    def decode_tps(self, prompt_len: int, steps: int, vocab: int, seed: int = 0) -> float:
        """Prefill `prompt_len` random tokens and one step (timed apart: last_prefill_s), then `steps`
        single-token steps."""
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        g = np.random.default_rng(seed)
        t0 = time.perf_counter()
        self._decode(g.integers(0, vocab, prompt_len).tolist())
        self._decode([int(g.integers(0, vocab))])
        self.last_prefill_s = time.perf_counter() - t0  # the prompt and the first step, as bench_cpu_decode times it
        t0 = time.perf_counter()
        for tok in g.integers(0, vocab, steps).tolist():
            self._decode([tok])
        return steps / (time.perf_counter() - t0)

    def close(self) -> None:
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)
