"""`hybridmoe bench shape NAME OUT [--layers N]`: write the shape's config.json into OUT."""

from __future__ import annotations

from pathlib import Path

from hybridmoe.args import OneLineParser
from hybridmoe.bench.shapes import SHAPES, write_shape_dir

PROG = "hybridmoe bench shape"


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog=PROG, description=__doc__)
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument("out", help="directory to write config.json into (created)")
    p.add_argument("--layers", type=int, default=None, help="cut the depth to this many decoder layers")
    a = p.parse_args(argv)
    if a.layers is not None and a.layers < 1:  # (shape_config's ValueError was a traceback)
        p.error(f"--layers: got {a.layers}, expected at least 1")
    out = Path(a.out)
    if out.exists() and not out.is_dir():  # mkdir(exist_ok=True) raised FileExistsError for a file (/dev/null)
        p.error(f"OUT {a.out}: exists and is not a directory (config.json is written into it)")
    try:
        d = write_shape_dir(a.name, out, a.layers)
    except OSError as e:  # an unwritable place: one line naming it, no traceback
        p.error(f"OUT {a.out}: cannot write config.json there: {e.strerror or e}")
    print(f"wrote {d / 'config.json'}; use it with --model-path {d} --load-format dummy --skip-tokenizer-init")
    return 0
