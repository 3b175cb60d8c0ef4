"""Which files a GGUF model is: one .gguf file, a split set (`NAME-00001-of-0000N.gguf`, any part or
the directory holding it), or a directory with one model. Pure path logic (no hybridmoe imports),
so config validation can recognise a GGUF `--model` without an import cycle.
"""

from __future__ import annotations

import re
from pathlib import Path

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class GGUFPathError(ValueError):
    """A GGUF path that names no complete model (missing, several models, a missing split part)."""


def is_gguf_model(path: str | Path) -> bool:
    """True for a .gguf file, or a directory holding .gguf files and no config.json (a Hugging Face
    directory with a stray GGUF beside it is still a Hugging Face directory)."""
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def split_parts(path: str | Path) -> list[Path]:
    """The files of the model at `path` (a .gguf file, one part of a split set, or a directory)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.gguf"))
        if not files:
            raise GGUFPathError(f"{p}: no .gguf file in this directory")
        stems = {m["stem"] if (m := SPLIT.match(f.name)) else f.name for f in files}
        if len(stems) > 1:
            raise GGUFPathError(f"{p}: holds several GGUF models ({', '.join(sorted(stems))}); pass one file")
        p = files[0]
    if not p.is_file():
        raise GGUFPathError(f"{p}: no such GGUF file")
    m = SPLIT.match(p.name)
    if m is None:
        return [p]
    n, i = int(m["n"]), int(m["i"])
    if not 1 <= i <= n:  # "-00001-of-00000" would make an empty set; "-00003-of-00002" is in no set
        raise GGUFPathError(f"{p}: part {i} of {n} is not a part of a split set (parts run from 00001 to the count); "
                            "rename it or pass another part")
    parts = [p.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [str(q) for q in parts if not q.is_file()]
    if missing:
        raise GGUFPathError(f"{p}: split set of {n} files is incomplete; missing {', '.join(missing)}")
    return parts
