"""Helpers of the convert tests: run the converter in this process, read a directory's bytes."""

from __future__ import annotations

from pathlib import Path

from hybridmoe.convert import main as convert_main


def run_convert(src: Path, out: Path, method: str, *extra: str, input_type: str = "bf16") -> int:
    """The converter in this process (its exit code)."""
    return convert_main(["--input-path", str(src), "--output", str(out), "--quant-method", method,
                         "--input-type", input_type, "--no-progress", *extra])


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
