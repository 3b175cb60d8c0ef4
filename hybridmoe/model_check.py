"""Startup checks of a model directory, before anything is loaded: config.json's values (sizes,
top-k against the expert count, head and group counts), the tokenizer files, and the safetensors
shards (every tensor the model reads is present, complete, of the expected shape and dtype).

Each check raises CheckpointError with one line naming the file, field or tensor and what was
expected; nothing here reads tensor data (headers only), so the checks cost well under a second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybridmoe.layers.rotary import rope_params_of
from hybridmoe.weights.loader import CheckpointError, load_hf_config
from hybridmoe.weights.shards import DTYPES, TensorInfo, scan_checkpoint

INT_LIMIT = 2**31 - 1
# Counts that something loops over or allocates by before any tensor is compared: far above every published
# model, far below what takes minutes or all memory. Layers: transformers' own config classes and the arch
# specs loop over them (Qwen2-MoE's config took 20 s for 10^7 layers, Qwen3-MoE's spec hung on 2^31-1 and
# DeepSeek-V3's ended in a MemoryError); the deepest published MoE has 94 (Qwen3-235B). Positions: the RoPE
# tables hold every position (2^31-1 was a 68 GB allocation at load); the longest published context is 10M
# (Llama-4-Scout).
MAX_LAYERS = 4096
MAX_POSITIONS = 1 << 24
_MAX_CONFIG_BYTES = 16 << 20  # config.json files are kilobytes; a huge one (or a sparse 1 TB one) was read whole
_MAX_JSON_BYTES = 256 << 20  # the other JSON files (tokenizer.json: tens of MB at most)
LOADABLE_DTYPES = ("F32", "F16", "BF16")  # what weights/loader.py copies into the model
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def one_line(text: str) -> str:
    """Any message as one line (transformers and tokenizers errors span several)."""
    return " ".join(str(text).split())


def _read_json(path: Path, limit: int = _MAX_JSON_BYTES) -> object:
    try:
        size = path.stat().st_size
        text = path.read_text() if size <= limit else None  # read whole: a huge (or sparse) file took its size
        if text is not None:
            return json.loads(text)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from e
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:  # json's parser recurses per nesting level: [[[...]]] 100000 deep
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from e
    raise CheckpointError(f"{path}: {size} bytes, more than a {path.name} file can be ({limit >> 20} MiB)")


def load_checked_config(model_path: str, trust_remote_code: bool = False, flag: str = "--model-path"):
    """(transformers config, ArchSpec) of a model directory whose config.json passed `check_config`;
    `flag` names the option that gave the directory."""
    from hybridmoe.models.registry import arch_spec

    root = Path(model_path)
    if not root.is_dir():
        if root.exists():  # e.g. its config.json or a shard given instead of the directory
            raise CheckpointError(f"{flag} {root}: not a directory (expected a Hugging Face model directory with "
                                  "config.json and *.safetensors files, or a .gguf file)")
        raise CheckpointError(f"{flag} {root}: no such directory")
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{root}: no config.json (expected a Hugging Face model directory)")
    raw = _read_json(path, _MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(raw).__name__}")
    _check_raw_config(raw, path)
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if level > hf_logging.DEBUG:  # its warnings about the config would repeat, in other words, what check_config says
        hf_logging.set_verbosity_error()
    try:
        config = load_hf_config(model_path, trust_remote_code)
        _check_spec_inputs(config, raw, path)
        spec = arch_spec(config, str(path))
    except (CheckpointError, ValueError) as e:
        raise CheckpointError(one_line(str(e))) from e
    except TypeError as e:  # a value of a type the checks above did not foresee, met by an arch spec
        raise CheckpointError(f"{path}: a value of the wrong type: {one_line(str(e))}") from e
    finally:
        hf_logging.set_verbosity(level)
    check_config(config, spec, raw, path)
    return config, spec


# the most a count may be (check_config's `count`); the others are at most INT_LIMIT
_COUNT_LIMITS = {"num_hidden_layers": MAX_LAYERS, "max_position_embeddings": MAX_POSITIONS}


def _check_raw_config(raw: dict, path: Path) -> None:
    """What transformers would loop over, or fail on deep inside (a message naming no field), before
    check_config sees the values: counts above their limit, and fields of the wrong JSON type."""
    for key, high in _COUNT_LIMITS.items():
        v = raw.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > high:
            raise CheckpointError(f"{path}: {key} is {v}, expected an integer in [1, {high}]")
    for key in ("model_type", "dtype", "torch_dtype"):  # a list was "unhashable type" / "list index out of range"
        v = raw.get(key)
        if v is not None and not isinstance(v, str):
            raise CheckpointError(f"{path}: {key} is {v!r}, expected a string")
    q = raw.get("quantization_config")
    if q is not None and not isinstance(q, dict):  # was "'list' object has no attribute 'to_dict'"
        raise CheckpointError(f"{path}: quantization_config is {q!r:.80}, expected a JSON object")


# config values the architecture specs compute with (models/*.py) before check_config sees them; an alias
# (num_local_experts -> num_experts) reaches the config without transformers' own type check
_SPEC_INTS = (*_EXPERT_KEYS, "num_experts_per_tok", "num_hidden_layers", "decoder_sparse_step", "first_k_dense_replace",
              "moe_layer_freq", "moe_intermediate_size", "intermediate_size", "n_shared_experts", "n_group",
              "topk_group")


def _check_spec_inputs(config, raw: dict, path: Path) -> None:
    """Integers where the architecture specs need them, and mlp_only_layers a list of them."""
    for key in _SPEC_INTS:
        v = raw[key] if key in raw else getattr(config, key, None)
        # an expert count given as null reaches the spec unchecked through an alias (was "TypeError: '>' not
        # supported"); the other keys may be null (unset)
        required = key in _EXPERT_KEYS and key in raw
        if (v is not None or required) and (not isinstance(v, int) or isinstance(v, bool)):
            raise CheckpointError(f"{path}: {key} is {v!r}, expected an integer")
    only = raw.get("mlp_only_layers", getattr(config, "mlp_only_layers", None))
    if only is not None and (not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                                    for i in only)):
        raise CheckpointError(f"{path}: mlp_only_layers is {only!r}, expected a list of layer indices")


def check_config(config, spec, raw: dict, path: Path) -> None:
    """The values the model is built from: positive sizes, top-k <= experts, heads dividing, groups."""
    def bad(key: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: {key} is {raw.get(key, getattr(config, key, None))!r}, expected {expected}")

    def count(key: str, low: int = 1, value: object = None) -> int:
        v = getattr(config, key, None) if value is None else value
        high = _COUNT_LIMITS.get(key, INT_LIMIT)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise bad(key, f"an integer >= {low}" if high == INT_LIMIT else f"an integer in [{low}, {high}]")
        return v

    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        count(key)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None)
    kv = count("num_key_value_heads", value=heads if kv is None else kv)  # 0 is not "unset": it was taken as heads
    if heads % kv:
        raise bad("num_key_value_heads", f"a divisor of num_attention_heads ({heads})")
    if is_mla_config(config):  # head sizes are qk_nope/qk_rope/v_head_dim (transformers' head_dim is derived)
        check_mla(config, bad, count)
    else:
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None:
            count("head_dim")
        elif config.hidden_size % heads:
            raise bad("num_attention_heads",
                      f"a divisor of hidden_size ({config.hidden_size}) when head_dim is not given")
        if (head_dim or config.hidden_size // heads) % 2:  # rotary embeddings rotate pairs of channels
            raise bad("head_dim" if head_dim is not None else "num_attention_heads", "an even head size")
    eps = getattr(config, "rms_norm_eps", None)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and 0 < eps < 1):
        raise bad("rms_norm_eps", "a small positive number")
    try:  # a NaN or non-positive RoPE setting made NaN cos/sin tables (NaN logits), or failed in the model build
        rope_params_of(config, str(path))
    except ValueError as e:
        raise CheckpointError(one_line(str(e))) from e
    check_fp8_quantization(config, path)
    if getattr(config, "first_k_dense_replace", None) is not None:  # DeepSeek family: dense layers, then MoE
        check_deepseek_moe(config, bad, count)
    given = next((k for k in _EXPERT_KEYS if k in raw), None)
    if given is not None:  # 0 or fewer made every layer dense: the error was a dense MLP tensor "missing"
        count(given, value=raw[given])
    if not spec.moe_layers:
        return
    experts_key = given or _EXPERT_KEYS[0]
    n_exp = count(experts_key, value=spec.num_experts)
    top_k = count("num_experts_per_tok", value=spec.top_k)
    if top_k > n_exp:
        raise CheckpointError(f"{path}: num_experts_per_tok {top_k} is above {experts_key} {n_exp}: expected "
                              f"1 <= num_experts_per_tok <= {experts_key}")
    count("moe_intermediate_size" if "moe_intermediate_size" in raw else "intermediate_size",
          value=spec.moe_intermediate)
    if len(spec.moe_layers) < config.num_hidden_layers:
        count("intermediate_size", value=spec.dense_intermediate)
    if getattr(config, "n_shared_experts", None) is None:  # DeepSeek's were checked as n_shared_experts
        count("shared_expert_intermediate_size", low=0, value=spec.shared_intermediate)
    step = getattr(config, "decoder_sparse_step", 1)
    if step is not None:
        count("decoder_sparse_step", value=step)
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if n_group is not None or topk_group is not None:  # grouped top-k (DeepSeek): groups, then experts
        count("n_group", value=n_group)
        if n_exp % n_group:
            raise bad("n_group", f"a divisor of {experts_key} ({n_exp})")
        if count("topk_group", value=topk_group) > n_group:
            raise bad("topk_group", f"at most n_group ({n_group})")
        if top_k > topk_group * (n_exp // n_group):
            raise CheckpointError(f"{path}: num_experts_per_tok {top_k} is above the {topk_group * (n_exp // n_group)}"
                                  " experts of the topk_group selected groups")


def is_mla_config(config) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the config has a KV latent rank."""
    return getattr(config, "kv_lora_rank", None) is not None


def check_mla(config, bad, count) -> None:
    """MLA sizes: a latent of kv_lora_rank, a query low-rank of q_lora_rank (None: a full q_proj),
    per-head nope/rope/value sizes; the rope part is rotated in pairs of channels."""
    count("kv_lora_rank")
    q_lora = getattr(config, "q_lora_rank", None)
    if q_lora is not None:
        count("q_lora_rank", value=q_lora)
    count("qk_nope_head_dim")
    if count("qk_rope_head_dim", low=2) % 2:
        raise bad("qk_rope_head_dim", "an even size (rotary embeddings rotate pairs of channels)")
    count("v_head_dim")


DEEPSEEK_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")  # V2, V2 (grouped), V3 (bias, groups)
DEEPSEEK_SCORING = ("softmax", "sigmoid")


def check_deepseek_moe(config, bad, count) -> None:
    """DeepSeek-family MoE fields: the dense layers before the first MoE one, the MoE layer period,
    shared experts, the routing method, score function and scale."""
    layers = config.num_hidden_layers
    if count("first_k_dense_replace", low=0) > layers:
        raise bad("first_k_dense_replace", f"at most num_hidden_layers ({layers})")
    if getattr(config, "moe_layer_freq", None) is not None:
        count("moe_layer_freq")
    if getattr(config, "n_shared_experts", None) is not None:
        count("n_shared_experts", low=0)
    for key, allowed in (("topk_method", DEEPSEEK_TOPK_METHODS), ("scoring_func", DEEPSEEK_SCORING)):
        v = getattr(config, key, None)
        if v is not None and v not in allowed:
            raise bad(key, f"one of {', '.join(allowed)}")
    scale = getattr(config, "routed_scaling_factor", None)
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not (math.isfinite(scale) and scale > 0)):
        raise bad("routed_scaling_factor", "a positive number")


def check_fp8_quantization(config, path: Path) -> None:
    """A block-scaled fp8 checkpoint (quant_method fp8) names its block: two positive sizes."""
    q = getattr(config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    if not q or q.get("quant_method") != "fp8":
        return
    block = q.get("weight_block_size")
    if block is None:
        return  # per-tensor fp8: nothing more to check here
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= INT_LIMIT for b in block)):
        raise CheckpointError(f"{path}: quantization_config.weight_block_size is {block!r}, expected two positive integers "
                              "(e.g. [128, 128])")


def check_tokens(config, model_path: str | Path, tokenizer_path: str | Path, tokenizer_size: int | None) -> None:
    """Special token ids and the tokenizer's size fit the vocabulary (ids past it would index past the
    embedding table)."""
    vocab = config.vocab_size
    for key in ("eos_token_id", "bos_token_id"):
        v = getattr(config, key, None)
        ids = v if isinstance(v, (list, tuple)) else [] if v is None else [v]
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
            raise CheckpointError(f"{Path(model_path) / 'config.json'}: {key} is {v!r}, expected token id(s) in "
                                  f"[0, {vocab})")
    if tokenizer_size is not None and tokenizer_size > vocab:
        raise CheckpointError(f"{Path(tokenizer_path) / 'tokenizer.json'}: {tokenizer_size} tokens, more than the "
                              f"model's vocab_size {vocab} (config.json): the last ids have no embedding")


def check_tokenizer(path: str | Path, trust_remote_code: bool = False) -> int | None:
    """The tokenizer files of a directory parse; the tokenizer's size with added tokens (None without
    tokenizer.json). A directory without tokenizer files is not an error (token-id input only). A
    tokenizer that is the checkpoint's own code (Kimi-K2's tiktoken one) needs --trust-remote-code
    and the packages its module imports."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"--tokenizer-path {root}: no such directory")
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        f = root / name
        if f.is_file() and not isinstance(_read_json(f), dict):
            raise CheckpointError(f"{f}: expected a JSON object")
    f = root / "tokenizer.json"
    if not f.is_file():
        check_remote_tokenizer(root, trust_remote_code)
        return None
    _read_json(f)  # names the line and column of a syntax error
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(f)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the Rust library raises a bare Exception
        raise CheckpointError(f"{f}: not a valid tokenizer: {one_line(str(e))}") from e


def remote_tokenizer_module(root: Path) -> tuple[str, str] | None:
    """(module file, class) of a tokenizer given as the checkpoint's own code: tokenizer_config.json's
    auto_map.AutoTokenizer names a class transformers does not have (None otherwise)."""
    f = root / "tokenizer_config.json"
    if not f.is_file():
        return None
    cfg = _read_json(f)
    ref = ((cfg.get("auto_map") or {}) if isinstance(cfg, dict) else {}).get("AutoTokenizer")
    if isinstance(ref, (list, tuple)):  # [slow, fast]: the first one given
        ref = next((r for r in ref if r), None)
    if not isinstance(ref, str) or "." not in ref or "--" in ref:  # "repo--module.Class": another repo's code
        return None
    module, cls = ref.rsplit(".", 1)
    import transformers

    if hasattr(transformers, cls):
        return None
    return f"{module}.py", cls


def check_remote_tokenizer(root: Path, trust_remote_code: bool) -> None:
    """A remote-code tokenizer can load: --trust-remote-code given, its module present, the packages
    it imports at the top level installed (e.g. tiktoken for Kimi-K2's tokenization_kimi.py)."""
    import ast
    import importlib.util

    found = remote_tokenizer_module(root)
    if found is None:
        return
    module, cls = found
    cfg = root / "tokenizer_config.json"
    if not trust_remote_code:
        raise CheckpointError(f"{cfg}: the tokenizer {cls} is the checkpoint's own code ({module}): pass "
                              "--trust-remote-code to run it (or --skip-tokenizer-init for token-id input only)")
    src = root / module
    if not src.is_file():
        raise CheckpointError(f"{cfg}: auto_map names the tokenizer {cls} in {module}, which is missing from {root}")
    try:
        tree = ast.parse(src.read_text(), str(src))
    except (OSError, SyntaxError, ValueError) as e:
        raise CheckpointError(f"{src}: cannot be read as Python: {one_line(str(e))}") from e
    needed = set()
    for node in tree.body:  # top-level imports only: those inside try blocks or functions are optional
        if isinstance(node, ast.Import):
            needed.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            needed.add(node.module.split(".")[0])
    missing = sorted(m for m in needed if importlib.util.find_spec(m) is None)
    if missing:
        hint = " (or `pip install hybridmoe[kimi]`)" if missing == ["tiktoken"] else ""
        raise CheckpointError(f"{src}: the tokenizer needs the package(s) {', '.join(missing)}, not installed: "
                              f"`pip install {' '.join(missing)}`{hint}")


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' names (utils/hub.py CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR)
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_TEMPLATE_WAY_OUT = "fix it, or pass --chat-template FILE_OR_NAME to use another"


def chat_templates_of(tokenizer_path: str | Path) -> list[tuple[str, str]]:
    """(where, Jinja source) of each chat template a tokenizer loaded from `tokenizer_path` carries, found as
    transformers finds them: chat_template.jinja and additional_chat_templates/*.jinja when there are any (they
    replace tokenizer_config.json's value), else tokenizer_config.json's chat_template (a string, or a list of
    {name, template}). `where` names the file (and the template); for a `--model FILE.gguf` view directory, the
    GGUF and its metadata key. CheckpointError for a template that cannot be read or is of the wrong type."""
    from hybridmoe.chat_templates import read_template_file
    from hybridmoe.gguf.view import gguf_source

    root = Path(tokenizer_path)
    gguf = gguf_source(root)

    def name(where: str) -> str:  # the view's files are ours, written from the GGUF: name where it came from
        return f"{gguf}: tokenizer.chat_template" if gguf is not None else where

    found: list[tuple[str, str]] = []
    files = [root / CHAT_TEMPLATE_FILE] if (root / CHAT_TEMPLATE_FILE).is_file() else []
    if (root / CHAT_TEMPLATE_DIR).is_dir():
        files += sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja"))  # each read whole by transformers, FIFOs too
    for f in files:
        try:
            found.append((name(str(f)), read_template_file(f, name(str(f)))))
        except ValueError as e:
            raise CheckpointError(f"{e}; {_TEMPLATE_WAY_OUT}") from None
    if files:
        return found
    f = root / "tokenizer_config.json"
    cfg = _read_json(f) if f.is_file() else {}
    value = cfg.get("chat_template") if isinstance(cfg, dict) else None
    where = name(f"{f}: chat_template")
    if value is None or isinstance(value, str):
        return [(where, value)] if value else []
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return [(name(f"{f}: chat_template {t['name']!r}"), t["template"]) for t in value]
    # transformers failed on these while loading the tokenizer (a TypeError naming no file)
    raise CheckpointError(f"{where} is {value!r:.80}, expected a string or a list of {{name, template}}; "
                          f"{_TEMPLATE_WAY_OUT}")


def check_chat_templates(tokenizer_path: str | Path) -> None:
    """Every chat template of the tokenizer (chat_templates_of) compiles, in the environment the chat routes
    render with: a broken one is one line naming the file, the Jinja error and its line, at startup (it failed
    each /v1/chat/completions request, blaming the messages, or `generate --chat` after the model loaded). No
    template is not an error: /v1/completions and token ids still serve."""
    from hybridmoe.chat_templates import check_template

    for where, source in chat_templates_of(tokenizer_path):
        try:
            check_template(source, where)
        except ValueError as e:
            raise CheckpointError(f"{e}; {_TEMPLATE_WAY_OUT}") from None


def check_weights(model_path: str, config, spec, experts: bool = True) -> dict[str, TensorInfo]:
    """Every tensor the model loads is in the checkpoint, complete (file size vs header), of the
    shape the config gives and of a loadable dtype; the routed experts too when `experts`."""
    import torch

    from hybridmoe.gguf.view import gguf_source
    from hybridmoe.models.base import MoECausalLM
    from hybridmoe.weights.fp8_loading import fp8_block_of as loader_fp8_block

    # the loader's own reading of quantization_config: what it refuses (gptq, fp8 without a block) is refused here,
    # before the load and in its words (this check's line was only "dtype F8_E4M3; bf16, fp16 or fp32 expected")
    try:
        block = loader_fp8_block(config)
    except ValueError as e:
        raise CheckpointError(f"{model_path}/{e}") from e
    gguf = gguf_source(model_path)  # a `--model FILE.gguf` view directory: the tensors are the GGUF's
    if gguf is None:
        tensors = scan_checkpoint(model_path)  # headers and file sizes: a truncated shard is named here
        check_counts(model_path, config, spec, tensors)
    else:
        from hybridmoe.gguf.weights import open_weights

        index, tensors = open_weights(gguf), {}
    with torch.device("meta"):  # shapes only: no memory
        try:
            model = MoECausalLM(config, spec, config.max_position_embeddings)
        except (ValueError, RuntimeError, TypeError) as e:
            raise CheckpointError(f"{model_path}/config.json: the model cannot be built from it: "
                                  f"{one_line(str(e))}") from e
    want: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        for src, dst in model.checkpoint_parts(name, param):
            want[src] = tuple(dst.shape)
    if model.tie_word_embeddings and "lm_head.weight" not in (tensors if gguf is None else index):
        want.pop("lm_head.weight", None)
    if experts:
        want.update(expert_shapes(config, spec))
    for name, shape in want.items():
        if gguf is not None:
            index.check(name, shape)
            continue
        t = _present(tensors, name, shape, model_path)
        if block is not None and t.dtype.startswith("F8") and len(shape) == 2:  # block-scaled fp8 (DeepSeek-V3)
            _fp8_scale(tensors, name, t, block)
        elif t.dtype not in LOADABLE_DTYPES:
            if block is None and t.dtype.startswith("F8"):  # the loader's words: what the checkpoint lacks
                raise CheckpointError(f"{t.file.name}: tensor {name!r} has dtype {DTYPES[t.dtype]}, but config.json has "
                                      "no quantization_config with quant_method 'fp8' and a weight_block_size")
            raise CheckpointError(f"{t.file.name}: tensor {name!r} has dtype {t.dtype}; bf16, fp16 or fp32 expected"
                                  + ("" if block is None else " (or fp8 with its block scale)"))
    return tensors


def fp8_block_of(config) -> tuple[int, int] | None:
    """[bn, bk] of a block-scaled fp8 checkpoint's config (quant_method fp8), else None."""
    q = getattr(config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    block = (q or {}).get("weight_block_size") if (q or {}).get("quant_method") == "fp8" else None
    return (int(block[0]), int(block[1])) if block else None


def _fp8_scale(tensors: dict[str, TensorInfo], name: str, t: TensorInfo, block: tuple[int, int]) -> TensorInfo:
    """The block scale of fp8 tensor `name`: present, of shape [ceil(N/bn), ceil(K/bk)]."""
    from hybridmoe.weights.fp8 import scale_name

    s = tensors.get(scale_name(name))
    if s is None:
        raise CheckpointError(f"{t.file.name}: tensor {name!r} is fp8 without its block scale {scale_name(name)!r}")
    want = tuple(-(-d // b) for d, b in zip(t.shape, block))
    if s.shape != want:
        raise CheckpointError(f"{s.file.name}: tensor {scale_name(name)!r} has shape {s.shape}, expected {want} "
                              f"(the {block[0]}x{block[1]} blocks of {name!r} {t.shape})")
    return s


def _present(tensors: dict[str, TensorInfo], name: str, shape: tuple[int, ...], model_path: str) -> TensorInfo:
    """The tensor `name`, which must exist with `shape`; a CheckpointError naming the file otherwise."""
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint {model_path}")
    if t.shape != shape:
        raise CheckpointError(f"{t.file.name}: tensor {name!r} has shape {t.shape}, expected {shape} from config.json")
    return t


def check_counts(model_path: str | Path, config, spec, tensors: dict[str, TensorInfo]) -> None:
    """The config's layer and routed-expert counts against the checkpoint, in time proportional to its
    tensors, before anything builds a model of that many layers or lists that many expert tensors: a count
    that passed the integer checks (2^31-1 experts) took hours there before the first missing tensor was
    named, and named no config field."""
    path = Path(model_path) / "config.json"
    layers = config.num_hidden_layers
    prefix = f"model.layers.{layers - 1}."
    if not any(name.startswith(prefix) for name in tensors):
        raise CheckpointError(f"{path}: num_hidden_layers is {layers}, but the checkpoint has no tensors of layer "
                              f"{layers - 1}")
    if not spec.moe_layers:
        return
    raw = _read_json(path, _MAX_CONFIG_BYTES)  # the key the error names: the one config.json spells
    key = next((k for k in _EXPERT_KEYS if k in (raw if isinstance(raw, dict) else {})), _EXPERT_KEYS[0])
    n = spec.num_experts
    last = spec.expert_tensor_names(spec.moe_layers[-1], n - 1)[0]
    if last not in tensors:
        raise CheckpointError(f"{path}: {key} is {n}, but the checkpoint has no tensor {last!r}")
    need = 3 * n * len(spec.moe_layers)
    if need > len(tensors):
        raise CheckpointError(f"{path}: {key} is {n}: {need} routed-expert tensors in {len(spec.moe_layers)} MoE "
                              f"layers, but the checkpoint has {len(tensors)} tensors in all")


def expert_shapes(config, spec) -> dict[str, tuple[int, int]]:
    """Name -> shape of every routed-expert tensor: gate and up [I, H], down [H, I]."""
    h, i = config.hidden_size, spec.moe_intermediate
    out = {}
    for layer in spec.moe_layers:
        for e in range(spec.num_experts):
            g, u, d = spec.expert_tensor_names(layer, e)
            out.update({g: (i, h), u: (i, h), d: (h, i)})
    return out


def check_expert_tensors(model_path: str, config, spec) -> dict[str, TensorInfo]:
    """The routed experts of a checkpoint are present, complete and of the config's shapes, and fp8
    ones have their block scale; all the checkpoint's tensors (their dtypes are the caller's to check)."""
    from hybridmoe.weights.fp8 import scale_name

    tensors = scan_checkpoint(model_path)
    check_counts(model_path, config, spec, tensors)
    block = fp8_block_of(config)
    for name, shape in expert_shapes(config, spec).items():
        t = _present(tensors, name, shape, model_path)
        if t.dtype.startswith("F8"):
            if block is not None:
                _fp8_scale(tensors, name, t, block)
            elif scale_name(name) not in tensors:
                raise CheckpointError(f"{t.file.name}: tensor {name!r} is fp8 without its block scale "
                                      f"{scale_name(name)!r}")
    return tensors
