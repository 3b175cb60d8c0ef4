"""`--model FILE.gguf`: the GGUF seen as a Hugging Face model directory.

The directory (in the cache, one per file set and its sizes and times) holds config.json
(gguf/model_config.py), the tokenizer files (gguf/tokenizer.py), generation_config.json and
gguf_source.json, which names the GGUF; the weights stay in the GGUF and are read from it
(gguf/weights.py). Everything that reads a model directory (config, tokenizer, chat template, EOS
ids) then works unchanged; the weight loader asks `gguf_source` where the tensors are.

    view = gguf_view("Qwen3-30B-A3B-Q4_K_M.gguf")   # Path of the directory (built once)
    gguf_source(view)                               # "/abs/Qwen3-30B-A3B-Q4_K_M.gguf"

No hybridmoe imports beyond gguf/paths, gguf/model_config and gguf/tokenizer: config validation
calls `adopt_gguf_model` (a GGUF --model) without an import cycle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from hybridmoe.gguf.model_config import GGUFConfigError, hf_config
from hybridmoe.gguf.open_part import open_parts
from hybridmoe.gguf.paths import GGUFPathError, is_gguf_model, split_parts
from hybridmoe.gguf.tokenizer import GGUFTokenizerError, save_tokenizer

SOURCE_FILE = "gguf_source.json"
VIEW_VERSION = 2  # bump when the files written here, or the checks made before writing them, change
ERRORS = (GGUFPathError, GGUFConfigError, GGUFTokenizerError)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridmoe" / "gguf"


def read_header(parts: list[Path]) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(metadata of the first part, every part's tensor shapes in torch order)."""
    meta: dict = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for i, r in enumerate(open_parts(parts)):  # GGUFPathError: unreadable, a tensor's data out of place, a mixed set
        if i == 0:
            for k, f in r.fields.items():
                try:
                    meta[k] = f.contents()
                except Exception:  # noqa: BLE001  (a field type the package cannot decode: not one we use)
                    meta[k] = None
        for t in r.tensors:
            shapes[t.name] = tuple(int(d) for d in reversed(list(t.shape)))
    return meta, shapes


def _key(parts: list[Path]) -> str:
    h = hashlib.sha256(str(VIEW_VERSION).encode())
    for p in parts:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def gguf_view(path: str | Path, root: Path | None = None) -> Path:
    """The model directory of the GGUF at `path` (built into the cache on first use, atomically)."""
    parts = split_parts(path)
    out = (root or cache_root()) / f"{parts[0].name.removesuffix('.gguf')}-{_key(parts)}"
    if (out / SOURCE_FILE).is_file():
        return out
    meta, shapes = read_header(parts)
    cfg = hf_config(meta, shapes, str(parts[0]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        save_tokenizer(parts[0], tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(Path(path).resolve()),
                                                   "parts": [str(p.resolve()) for p in parts]}, indent=2))
        try:
            tmp.rename(out)
        except OSError:  # another process built it meanwhile
            if not (out / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_source(model_dir: str | Path) -> str | None:
    """The GGUF a view directory stands for; None for any other directory."""
    f = Path(model_dir) / SOURCE_FILE
    if not f.is_file():
        return None
    return str(json.loads(f.read_text())["gguf"])


def adopt_gguf_model(args) -> None:
    """EngineArgs with a GGUF --model, in place: model_path becomes its view directory, the served
    name stays the GGUF's, and without --kt-weight-path the routed experts are computed from the GGUF's
    own blocks (--kt-method LLAMAFILE, --kt-weight-path the GGUF). Raises one of ERRORS."""
    if not is_gguf_model(args.model_path):
        return
    gguf = str(args.model_path)
    view = gguf_view(gguf)
    if args.served_model_name is None:
        args.served_model_name = gguf
    args.model_path = str(view)
    if args.kt_weight_path is None:
        args.kt_method = "LLAMAFILE"
        args.kt_weight_path = gguf
