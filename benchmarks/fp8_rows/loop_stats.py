"""Instructions per 64-byte weight line of the FP8/INT8 few-row kernels' inner loops, from the
object file (valgrind 3.19 cannot decode EVEX, so callgrind cannot count AVX-512 code: the loop
bodies are counted statically instead; every line of a block runs the same loop body; vec: zmm
instructions, loads: memory operands incl. embedded broadcasts). run.sh leaves a.o and b.o.

  python benchmarks/fp8_rows/loop_stats.py /tmp/fp8_rows.XXXX/b.o
"""

from __future__ import annotations

import argparse
import re
import subprocess

FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSN = re.compile(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$")
JUMP = re.compile(r"^j\w+$")


def functions(obj: str) -> dict[str, list[tuple[int, str, str]]]:
    """name -> [(address, mnemonic, operands)] from objdump."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", obj], capture_output=True, text=True,
                         check=True).stdout
    funcs: dict[str, list[tuple[int, str, str]]] = {}
    cur = None
    for line in out.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2), m.group(3).split("#")[0].strip()))
    return funcs


def inner_loops(body: list[tuple[int, str, str]], key: str) -> list[list[tuple[int, str, str]]]:
    """The innermost backward-branch spans that contain `key` (the dot instruction): no other such
    span inside them (a kernel inlined into gemm shows up as one of gemm's loops)."""
    spans = []
    for i, (_, mn, ops) in enumerate(body):
        if not JUMP.match(mn) or mn == "jmp":
            continue
        try:
            target = int(ops.split()[0], 16)
        except ValueError:
            continue
        j = next((k for k, ins in enumerate(body) if ins[0] == target), None)
        if j is not None and j <= i and any(ins[1].startswith(key) for ins in body[j:i + 1]):
            spans.append((j, i))
    inner = [(j, i) for j, i in spans if not any((a, b) != (j, i) and j <= a and b <= i for a, b in spans)]
    return [body[j:i + 1] for j, i in inner]


def inner_loop(body: list[tuple[int, str, str]], key: str) -> list[tuple[int, str, str]] | None:
    """The shortest backward-branch span that contains `key` (the dot instruction)."""
    best = None
    for i, (_, mn, ops) in enumerate(body):
        if not JUMP.match(mn) or mn == "jmp":
            continue
        try:
            target = int(ops.split()[0], 16)
        except ValueError:
            continue
        j = next((k for k, ins in enumerate(body) if ins[0] == target), None)
        if j is None or j > i:
            continue
        span = body[j:i + 1]
        if any(ins[1].startswith(key) for ins in span) and (best is None or len(span) < len(best)):
            best = span
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("obj")
    ap.add_argument("--match", default=r"blk_fp8|blk_i8|avx512::gemm\(")
    args = ap.parse_args()
    print(f"{'kernel':<34} {'lines/it':>8} {'instr/line':>10} {'vec/line':>9} {'loads/line':>10} {'dots/line':>9}")
    for name, body in sorted(functions(args.obj).items()):
        if not re.search(args.match, name):
            continue
        key = "vpdpbusd" if "blk_i8" in name else "vdpbf16ps"
        loops = inner_loops(body, key) if "gemm" in name else [inner_loop(body, key)]
        for loop in loops:  # gemm's own loops: only the FP8 ones (widening: vperm*2b) count
            if loop is not None and ("gemm" not in name or any("2b" in mn for _, mn, _ in loop)):
                print(row_of(name, key, loop))


def row_of(name: str, key: str, loop: list[tuple[int, str, str]]) -> str:
    """One table row: the loop's instruction counts per 64-byte weight line."""
    ops = [(mn, o) for _, mn, o in loop]
    dots = sum(mn.startswith(key) for mn, _ in ops)
    if "gemm" in name:  # the FP8 one-row kernel inlined (up to ad61aa4): pf when the loop prefetches
        short = "gemm: fp8 one-row loop" + (" [pf]" if any(mn.startswith("prefetch") for mn, _ in ops) else "")
    else:
        short = re.search(r"(blk_\w+(<[^()]*>)?)", name).group(1) + (" [pf]" if "true>" in name else "")
    rows = int(re.search(r"<(\d+)", short).group(1)) if "<" in short else 1
    lines = dots / (2 * rows) if key == "vdpbf16ps" else dots / rows  # fp8: 2 dots/row/line; int8: 1
    vec = sum("zmm" in o and not mn.startswith("prefetch") for mn, o in ops)
    loads = sum("(" in o and not mn.startswith(("prefetch", "lea", "nop")) for mn, o in ops)
    return (f"{short:<34} {lines:>8.0f} {len(ops) / lines:>10.2f} {vec / lines:>9.2f} {loads / lines:>10.2f} "
            f"{dots / lines:>9.1f}")


if __name__ == "__main__":
    main()
