"""`hybridmoe bench shape NAME OUT [--layers N]`: write the shape's config.json into OUT."""

from __future__ import annotations

import argparse

from hybridmoe.bench.shapes import SHAPES, write_shape_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridmoe bench shape", description=__doc__)
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument("out", help="directory to write config.json into (created)")
    p.add_argument("--layers", type=int, default=None, help="cut the depth to this many decoder layers")
    a = p.parse_args(argv)
    d = write_shape_dir(a.name, a.out, a.layers)
    print(f"wrote {d / 'config.json'}; use it with --model-path {d} --load-format dummy --skip-tokenizer-init")
    return 0
