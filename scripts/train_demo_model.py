#!/usr/bin/env python
"""Train the tiny bundled demo model ``hybridmoe/demo_model/`` from text that ships with Python.

The corpus is the documentation of the running interpreter's standard library: the docstrings of
its modules, classes, functions and methods, collected with :mod:`pkgutil`, :mod:`importlib` and
:mod:`inspect` in sorted module order, so any fresh machine with the same Python version rebuilds
the same text without network access.  A few ChatML exchanges ("What does ``json.dumps`` do?" ->
its summary line) are mixed in, so the model also learns to close an assistant turn with
``<|im_end|>``.

From that corpus the script

1. trains a byte-level BPE tokenizer (``tokenizers``, vocab 4096) with the special tokens
   ``<|endoftext|>`` (id 0), ``<|im_start|>`` (id 1) and ``<|im_end|>`` (id 2);
2. builds a small :class:`transformers.Qwen3MoeForCausalLM` (4 layers, hidden 128, 8 experts with
   top-2 routing, GQA 4 query / 2 key-value heads of dim 32) and trains it on the CPU with one
   thread, by default for 1300 steps of 16 x 128 tokens (about 13 minutes on one core), capped by a
   wall-clock limit;
3. writes a Hugging Face model directory (``config.json``, ``generation_config.json``,
   ``model.safetensors`` in bf16 with per-expert Hub tensor names, ``tokenizer.json``,
   ``tokenizer_config.json`` with a ChatML ``chat_template``, ``special_tokens_map.json``).

Usage::

    python scripts/train_demo_model.py                   # defaults, writes hybridmoe/demo_model/
    python scripts/train_demo_model.py --steps 50 --out /tmp/demo   # quick smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import random
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "hybridmoe" / "demo_model"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Top-level names (and their subpackages) never imported: GUI/IDE code, modules with import-time side
# effects (``antigravity`` opens a browser, ``this`` prints), test suites, deprecated or platform-only
# packages, and ``encodings`` (a hundred codec modules with almost no prose).
SKIP_TOP_LEVEL = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "test",
        "lib2to3",
        "distutils",
        "ensurepip",
        "venv",
        "pydoc_data",
        "encodings",
        "msilib",
        "msvcrt",
        "winreg",
        "winsound",
        "nt",
        "nturl2path",
        "ntpath",
        "xxlimited",
        "xxlimited_35",
        "xxsubtype",
        "crypt",
        "nis",
        "spwd",
        "ossaudiodev",
        "sndhdr",
        "imghdr",
        "cgi",
        "cgitb",
        "telnetlib",
        "pipes",
        "nntplib",
        "uu",
        "xdrlib",
        "chunk",
        "mailcap",
        "audioop",
        "aifc",
        "sunau",
        "_tkinter",
        "_msi",
        "_winapi",
        "_overlapped",
        "_scproxy",
        "_crypt",
        "_ctypes_test",
    }
)
SKIP_TOP_PREFIXES = ("__", "_test", "_xx", "_codecs_")
# Subpackage/submodule name parts that mark tests, demos or entry points.
SKIP_PARTS = frozenset({"test", "tests", "idle_test", "__main__", "_test", "testing"})


def set_seed(seed: int) -> None:
    """Seed Python's and torch's random number generators."""
    random.seed(seed)
    torch.manual_seed(seed)


def _quiet_import(name: str) -> ModuleType | None:
    """Import ``name`` with warnings and stdout/stderr silenced; ``None`` when it fails."""
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - SystemExit and friends from odd modules count as failures too
        return None


def iter_stdlib_modules() -> Iterator[ModuleType]:
    """Yield importable standard-library modules (public ones plus their public submodules), sorted by name."""
    top = sorted(n for n in sys.stdlib_module_names if not n.startswith(SKIP_TOP_PREFIXES) and n not in SKIP_TOP_LEVEL)
    for name in top:
        module = _quiet_import(name)
        if module is None:
            continue
        yield module
        path = getattr(module, "__path__", None)
        if not path:
            continue
        subnames: list[str] = []
        stack = [(list(path), name)]
        while stack:
            pkg_path, prefix = stack.pop()
            for info in pkgutil.iter_modules(pkg_path, prefix + "."):
                leaf = info.name.rsplit(".", 1)[-1]
                if leaf.startswith("_") or leaf in SKIP_PARTS or leaf.startswith("test"):
                    continue
                subnames.append(info.name)
                if info.ispkg:
                    sub = _quiet_import(info.name)
                    if sub is not None and getattr(sub, "__path__", None):
                        stack.append((list(sub.__path__), info.name))
        for subname in sorted(set(subnames)):
            sub = _quiet_import(subname)
            if sub is not None:
                yield sub


def _clean_docstring(doc: str) -> str:
    """Normalise a docstring: dedent, drop doctest lines, squeeze blank lines."""
    lines = []
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if stripped.startswith((">>>", "...")):
            continue
        lines.append(line.rstrip())
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip()


def _documented_objects(module: ModuleType) -> Iterator[tuple[str, object]]:
    """Yield ``(qualified name, object)`` for a module, its own classes/functions and their methods."""
    yield module.__name__, module
    try:
        members = inspect.getmembers(module)
    except Exception:  # noqa: BLE001 - lazy modules may raise from __getattr__
        return
    for name, obj in members:
        owner = getattr(obj, "__module__", None)
        # Public names defined here or re-exported from a private implementation module (``bisect`` <- ``_bisect``).
        if name.startswith("__") or not (owner == module.__name__ or (owner or "").startswith("_")):
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                if attr.startswith("__") and attr != "__init__":
                    continue
                member = vars(obj)[attr]
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property) or inspect.isfunction(member) or inspect.ismethoddescriptor(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def collect_docstrings(min_chars: int = 40) -> list[tuple[str, str]]:
    """Return ``(qualified name, cleaned docstring)`` pairs from the standard library, deduplicated, in order."""
    seen: set[str] = set()
    docs: list[tuple[str, str]] = []
    for module in iter_stdlib_modules():
        for qualname, obj in _documented_objects(module):
            raw = obj.__doc__ if isinstance(obj, (ModuleType, property)) else inspect.getdoc(obj)
            if not isinstance(raw, str):
                continue
            text = _clean_docstring(raw)
            if len(text) < min_chars or text in seen:
                continue
            seen.add(text)
            docs.append((qualname, text))
    return docs


def collect_language_reference() -> list[tuple[str, str]]:
    """Return ``(topic, text)`` pairs from ``pydoc_data.topics``: the language reference that ``help()`` shows."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    docs = []
    for name in sorted(topics):
        text = "\n".join(line.rstrip() for line in topics[name].splitlines() if not line.lstrip().startswith(">>>"))
        docs.append((name, text.strip()))
    return docs


def _summary_line(doc: str) -> str | None:
    """First paragraph of a docstring if it reads like a sentence, else ``None``."""
    para = " ".join(doc.split("\n\n", 1)[0].split())
    if "(" in para.split(" ", 1)[0] or not (20 <= len(para) <= 300) or not para[0].isupper():
        return None
    return para if para.endswith(".") else para + "."


def build_corpus(docs: list[tuple[str, str]], chat_every: int = 8) -> list[str]:
    """Turn docstrings into training documents: plain text plus, every ``chat_every`` documents, a ChatML turn."""
    out: list[str] = []
    for i, (qualname, text) in enumerate(docs):
        out.append(text)
        summary = _summary_line(text)
        if chat_every and i % chat_every == 0 and summary is not None:
            out.append(f"{IM_START}user\nWhat does `{qualname}` do?{IM_END}\n{IM_START}assistant\n{summary}{IM_END}\n")
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose first ids are the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def build_model(vocab_size: int, args: argparse.Namespace, eos_id: int, pad_id: int) -> Qwen3MoeForCausalLM:
    """Create the randomly initialised Qwen3-MoE model described by ``args``."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # dense MLP size; unused since every layer is sparse
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_loss_coef,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="bfloat16",
    )
    return Qwen3MoeForCausalLM(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak learning rate."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model: Qwen3MoeForCausalLM, data: torch.Tensor, seq_len: int, batches: int = 4) -> float:
    """Mean next-token loss over the first few contiguous windows of ``data``."""
    model.eval()
    losses = []
    n = (len(data) - 1) // seq_len
    for b in range(min(batches, max(1, n // 16))):
        starts = torch.arange(b * 16, min(n, (b + 1) * 16)) * seq_len
        x = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        losses.append(model(input_ids=x[:, :-1], labels=x[:, :-1]).loss.item())
    model.train()
    return sum(losses) / max(1, len(losses))


def train(
    model: Qwen3MoeForCausalLM, train_ids: torch.Tensor, val_ids: torch.Tensor, args: argparse.Namespace
) -> float:
    """Train ``model`` on random windows of ``train_ids``; returns the last logged training loss."""
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "norm" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    start = last = time.time()
    tokens_since = 0
    running = float("nan")
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()])
        out = model(input_ids=x, labels=x, output_router_logits=args.aux_loss_coef > 0)
        out.loss.backward()  # includes router_aux_loss_coef * load-balancing loss when enabled
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = out.loss.item() - (args.aux_loss_coef * out.aux_loss.item() if out.aux_loss is not None else 0.0)
        running = lm_loss if math.isnan(running) else 0.9 * running + 0.1 * lm_loss
        tokens_since += x.numel()
        elapsed = time.time() - start
        done = step + 1 == args.steps or elapsed > args.max_minutes * 60
        if (step + 1) % args.log_every == 0 or done:
            now = time.time()
            msg = (
                f"step {step + 1:5d}/{args.steps} loss {lm_loss:.3f} (ema {running:.3f}) "
                f"lr {lr_at(step, args):.2e} {tokens_since / (now - last):7.0f} tok/s elapsed {elapsed / 60:5.1f} min"
            )
            if (step + 1) % (args.log_every * 10) == 0 or done:
                msg += f" val {eval_loss(model, val_ids, args.seq_len):.3f}"
            print(msg, flush=True)
            last, tokens_since = now, 0
        if done:
            if step + 1 < args.steps:
                print(f"stopping at the {args.max_minutes} min wall-clock limit", flush=True)
            break
    return running


def save_tokenizer(tok: Tokenizer, out: Path, max_positions: int) -> PreTrainedTokenizerFast:
    """Wrap ``tok`` as a transformers fast tokenizer with a ChatML template and save it to ``out``."""
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END, ENDOFTEXT],
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out, save_jinja_files=False)
    # Rewrite the two small JSON files in the classic (transformers 4.x and 5.x readable) layout, with the
    # chat template inside tokenizer_config.json rather than a separate chat_template.jinja.
    special_map = {
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END, ENDOFTEXT],
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "unk_token": None,
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return hf_tok


def add_legacy_config_keys(out: Path) -> None:
    """Add the Hub-style keys (``num_experts``, ``rope_theta``, ``torch_dtype``) next to transformers 5 names."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("num_experts", config.get("num_local_experts"))
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def sample_generations(model: Qwen3MoeForCausalLM, hf_tok: PreTrainedTokenizerFast, prompts: list[str]) -> None:
    """Print greedy continuations of ``prompts``."""
    model.eval()
    for prompt in prompts:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=hf_tok.pad_token_id)
        print(f"  {prompt!r} -> {hf_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)!r}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model directory (replaced)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--aux-loss-coef", type=float, default=0.01, help="router load-balancing loss weight")
    p.add_argument("--steps", type=int, default=1300, help="optimizer steps")
    p.add_argument("--max-minutes", type=float, default=15.0, help="stop training after this wall time")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the corpus, train tokenizer and model, and write the model directory."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = time.time()
    docs = collect_docstrings()
    texts = build_corpus(docs) + [text for _, text in collect_language_reference()]
    n_bytes = sum(len(t.encode()) for t in texts)
    print(f"corpus: {len(docs)} docstrings, {len(texts)} documents, {n_bytes / 1e6:.2f} MB ({time.time() - t0:.1f} s)")

    t0 = time.time()
    tok = train_tokenizer(texts, args.vocab_size)
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2], "special tokens must be ids 0, 1, 2"
    eot_id, im_end_id = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot_id)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = max(args.seq_len * 64 + 1, len(data) // 50)
    train_ids, val_ids = data[:-n_val], data[-n_val:]
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, {len(data)} tokens ({n_bytes / len(data):.2f} bytes/token), "
        f"train {len(train_ids)} / val {len(val_ids)} ({time.time() - t0:.1f} s)"
    )

    model = build_model(tok.get_vocab_size(), args, eos_id=eot_id, pad_id=eot_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters; config {model.config.to_json_string(use_diff=True)}", flush=True)

    t0 = time.time()
    final = train(model, train_ids, val_ids, args)
    print(f"training: {(time.time() - t0) / 60:.1f} min, final loss (ema) {final:.3f}", flush=True)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf_tok = save_tokenizer(tok, out, args.max_positions)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[im_end_id, eot_id],
        pad_token_id=eot_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        repetition_penalty=1.1,
        max_new_tokens=64,
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    add_legacy_config_keys(out)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; package data must be world-readable
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 1e6:.2f} MB): {', '.join(sorted(f.name for f in out.iterdir()))}")
    sample_generations(model.float(), hf_tok, ["Return the", "The default value", "This module provides"])


if __name__ == "__main__":
    main()
