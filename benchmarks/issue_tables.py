"""The acceptance tables of the performance issues from one device run's JSON files: for every point, the value
measured, the ceiling it is a ratio of (from the same run), the ratio, the target and whether it is met.

Reads the files `run_device_suite.sh OUT` writes (names below; `--file key=path` for others) and skips a point
whose file is missing. Prints a markdown table; `--json` writes the rows.

    python benchmarks/issue_tables.py OUT --device "H200 host" --commit abc1234
    python benchmarks/issue_tables.py results/session26 --file decode=results/session26/decode_spread.json

Issue 16 (performance): 1 deferral (CPU busy d2 / d0 <= 1.05, pool idle before a task <= 20 us, d2 faster than d0
at batch 1), 2 hybrid decode at batch 1 (>= 0.70 of the best-probe bound at the default deferral; batch 4 and 16
>= 1.2x the issue's 71.3 and 98.4 tok/s), 3 CPU MoE prefill (AMXINT4 T 1024 / 4096 >= 5 / 6 TFLOP/s, AMXINT8 T 4096
>= 7), 4 serving (ITL p50 within 10% of the offline decode step, TTFT p50 <= 30 ms), 5 all-GPU decode (batch 1 >=
0.45 of the weight-read bound, batch 64 >= 4500 tok/s). Issue 18 (GGUF): Q4_K and Q8_0 experts at T 1, 4, 16 >=
0.75 of the best stream probe; large T and hybrid GGUF decode reported. Issue 15 (DeepSeek-V3): the absorbed MLA
decode at context >= 8K >= 0.5 of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

FILES = {  # key -> file name in OUT (run_device_suite.sh)
    "decode": "decode.json", "hybrid": "hybrid_decode.json", "int8": "cpu_moe_AMXINT8.json",
    "int4": "cpu_moe_AMXINT4.json", "serving": "serving.json", "gguf": "gguf_moe.json",
    "gguf_large": "gguf_moe_large.json", "hybrid_gguf": "hybrid_decode_gguf.json", "mla": "mla.json",
    "ab_decode": "ab_decode.json",  # benchmarks/ab_decode_kernels.py
}
DEFAULT_DEFERRAL = 0  # --kt-max-deferred-experts-per-token's default (hybridmoe/config.py)


@dataclass
class Row:
    issue: int
    point: str
    what: str
    value: float
    unit: str
    ceiling: str = ""  # what the ratio divides by, with its value
    target: str = ""
    met: bool | None = None  # None: reported only
    source: str = ""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _default_settings(rows: list[dict], prefetch_default: int | None = None) -> list[dict]:
    """The rows (runs or summary entries) of the engine's default settings: a bench_hybrid_decode.py A/B's
    `--fuse` (session 27: `--fused-reduce`) rows other than `on`, `--block-prefetch` rows other than 1,
    `--items-per-thread` rows other than 8, `--stream-wait hostfn` rows (memop is the default where the driver has
    it, session 30), `--merge-deferred off` and `--handoff off` rows, and `--prefetch` rows other than the host's
    default distance (the file's prefetch_bytes_default) left out (files from before the options have none)."""
    pf = prefetch_default
    return [r for r in rows if r.get("fuse", r.get("fused_reduce", "on")) == "on" and r.get("block_prefetch", 1) == 1
            and r.get("items_per_thread", 8) == 8 and r.get("stream_wait", "memop") == "memop"
            and r.get("merge_deferred", "on") == "on" and r.get("handoff", "on") != "off"
            and (pf is None or r.get("prefetch_bytes", pf) == pf)]


def issue16_deferral(d: dict, src: str) -> list[Row]:
    runs = [r for r in _default_settings(d["runs"], d.get("prefetch_bytes_default")) if r["batch"] == 1]
    busy = {k: _median([r["cpu_busy_ms_per_step"] for r in runs if r["deferred"] == k]) for k in (0, 2)}
    tps = {k: _median([r["tokens_per_s"] for r in runs if r["deferred"] == k]) for k in (0, 2)}
    idle = _median([r["cpu_trace"]["idle_before_us"] for r in runs if r["deferred"] == 2 and r.get("cpu_trace")])
    if not (busy[0] == busy[0] and busy[2] == busy[2]):  # no runs of one of the two settings
        return []
    ratio = busy[2] / busy[0]
    return [
        Row(16, "1", "CPU busy a step, deferral 2 / 0 (batch 1, medians)", ratio, "x",
            f"d0 {busy[0]:.2f} ms, d2 {busy[2]:.2f} ms", "<= 1.05", ratio <= 1.05, src),
        Row(16, "1", "pool idle before a task, deferral 2 (median of runs)", idle, "us", "", "<= 20", idle <= 20, src),
        Row(16, "1", "deferral 2 against 0 at batch 1 (median tok/s)", tps[2] / tps[0], "x",
            f"d0 {tps[0]:.1f}, d2 {tps[2]:.1f} tok/s", "> 1", tps[2] > tps[0], src),
    ]


def issue16_hybrid(d: dict, src: str) -> list[Row]:
    rows = []
    summary = _default_settings(d.get("summary", []), d.get("prefetch_bytes_default"))
    summ = {(s["deferred"], s["batch"]): s for s in summary}
    best_probe = max(d.get("stream_probes_gbps") or [float("nan")])
    for k in sorted({s["deferred"] for s in summary if s["batch"] == 1}):
        s = summ[(k, 1)]
        ratio = s.get("median_ratio_to_best_probe_bound", float("nan"))
        is_default = k == DEFAULT_DEFERRAL
        rows.append(Row(16, "2", f"hybrid decode batch 1, deferral {k}{' (the default)' if is_default else ''}",
                        s["median_tokens_per_s"], "tok/s", f"best probe {best_probe:.0f} GB/s", ">= 0.70 (default)",
                        ratio >= 0.70 if is_default else None, src))
        rows[-1].ceiling += f"; ratio {ratio:.3f}"
    for b, want in ((4, 1.2 * 71.3), (16, 1.2 * 98.4)):
        cands = [s["median_tokens_per_s"] for (k, bb), s in summ.items() if bb == b]
        if cands:
            rows.append(Row(16, "2", f"hybrid decode batch {b} (best deferral)", max(cands), "tok/s", "",
                            f">= {want:.1f}", max(cands) >= want, src))
    return rows


def issue16_cpu(d: dict, src: str, method: str) -> list[Row]:
    want = {("AMXINT4", 1024): 5.0, ("AMXINT4", 4096): 6.0, ("AMXINT8", 4096): 7.0}
    rows = []
    for (m, t), target in want.items():
        if m != method:
            continue
        vals = [r["tflops"] for r in d["results"] if r["T"] == t and r.get("method", m) == m]
        if vals:
            v = _median(vals)
            rows.append(Row(16, "3", f"{m} CPU MoE op, T {t} ({len(vals)} rows, median)", v, "TFLOP/s", "",
                            f">= {target}", v >= target, src))
    return rows


def issue16_serving(d: dict, src: str) -> list[Row]:
    step = d.get("offline_decode_step_ms")
    cfg = d.get("config", {})
    rows = []
    for r in d["results"]:
        if r["concurrency"] != 1:
            continue
        ov = r.get("overlap")
        tag = f"concurrency 1{', overlap ' + str(ov) if ov in (True, False, 'on', 'off') else ''}"
        if step:
            ratio = r["itl_ms_p50"] / step
            rows.append(Row(16, "4", f"ITL p50 / offline decode step ({tag})", ratio, "x",
                            f"ITL {r['itl_ms_p50']:.2f} ms / step {step:.2f} ms", "<= 1.10", ratio <= 1.10, src))
        rows.append(Row(16, "4", f"TTFT p50, {cfg.get('input_len', '?')}-token prompts ({tag})", r["ttft_ms_p50"],
                        "ms", "", "<= 30", r["ttft_ms_p50"] <= 30, src))
    return rows


def issue16_decode(d: dict, src: str) -> list[Row]:
    rows = []
    routing = d.get("shape", {}).get("routing") or ""
    for r in d["runs"]:
        if r.get("graphs", "on") != "on":
            continue
        if r["batch"] == 1:
            rows.append(Row(16, "5", f"all-GPU decode batch 1 {routing}".strip(), r["tokens_per_s"], "tok/s",
                            f"bound {r['bound_tokens_per_s']:.0f} tok/s (copy {d['copy_bw'] / 1e9:.0f} GB/s); "
                            f"ratio {r['ratio_to_bound']:.3f}", ">= 0.45", r["ratio_to_bound"] >= 0.45, src))
        if r["batch"] == 64:
            rows.append(Row(16, "5", f"all-GPU decode batch 64 {routing}".strip(), r["tokens_per_s"], "tok/s", "",
                            ">= 4500", r["tokens_per_s"] >= 4500, src))
    return rows


def issue16_ab_decode(d: dict, src: str) -> list[Row]:
    """ab_decode_kernels.py: batch 1 of each variant (the last one is the engine's default) against its bound."""
    bound = d["bound_b1"]
    names = list(dict.fromkeys(r["variant"] for r in d["rows"]))
    rows = []
    for name in names:
        med = d["medians"].get(f"{name}/b1")
        if med is None:
            continue
        default = name == names[-1]
        rows.append(Row(16, "5", f"all-GPU decode batch 1, {name}{' (the default)' if default else ''} (median of "
                        f"{len({r['round'] for r in d['rows']})} rounds)", med, "tok/s",
                        f"bound {bound:.0f} tok/s; ratio {med / bound:.3f}", ">= 0.45", (med / bound >= 0.45)
                        if default else None, src))
    return rows


def issue18_gguf(d: dict, src: str) -> list[Row]:
    """Decode sizes against the best probe (at the host's default prefetch distance, the file's
    prefetch_bytes_default; files from before session 40 have none: the run's first distance; `--fuse` rows other
    than `on` and `--block-prefetch` rows other than the default 1 left out; files from before session 29 have no bp
    key: their rows ran without it); large T in TFLOP/s (median of the rounds), reported."""
    rows = []
    first_pf = d["summary"][0]["prefetch"] if d.get("summary") else None
    if d.get("prefetch_bytes_default") is not None and any(
            s["prefetch"] == d["prefetch_bytes_default"] for s in d.get("summary", [])):
        first_pf = d["prefetch_bytes_default"]
    bps = {s.get("bp", 0) for s in d.get("summary", [])}
    want_bp = 1 if 1 in bps else 0
    for s in d.get("summary", []):
        if s["prefetch"] != first_pf or s["T"] > 16 or s.get("fuse", "on") != "on" or s.get("bp", 0) != want_bp:
            continue
        r = s["ratio_to_stream"]
        target = s["type"] in ("Q4_K", "Q8_0")
        rows.append(Row(18, "speed", f"{s['type']} experts T {s['T']} (prefetch {s['prefetch']})", s["GB/s"], "GB/s",
                        f"best probe {d['stream_read_gbps']:.1f} GB/s; ratio {r:.3f}", ">= 0.75" if target else "",
                        (r >= 0.75) if target else None, src))
    on = [r for r in d.get("rows", []) if r.get("fuse", "on") == "on"]
    large = sorted({(r["type"], r["T"]) for r in on if r["T"] > 16})
    for typ, t in large:
        v = _median([r["TFLOP/s"] for r in on if (r["type"], r["T"]) == (typ, t)])
        rows.append(Row(18, "speed", f"{typ} experts T {t}", v, "TFLOP/s", "", "reported", None, src))
    return rows


def issue18_hybrid(d: dict, src: str) -> list[Row]:
    return [Row(18, "speed", f"hybrid GGUF decode batch {s['batch']}, deferral {s['deferred']}",
                s["median_tokens_per_s"], "tok/s",
                f"ratio to the best-probe bound {s.get('median_ratio_to_best_probe_bound', float('nan')):.3f}",
                "reported", None, src) for s in _default_settings(d.get("summary", []), d.get("prefetch_bytes_default"))]


def issue15_mla(d: dict, src: str) -> list[Row]:
    rows = []
    for r in d["rows"]:
        if r["context"] >= 8192 and "absorbed_ratio" in r:
            rows.append(Row(15, "MLA", f"absorbed MLA decode, batch {r['batch']}, context {r['context']}",
                            r["absorbed_gbps"], "GB/s", f"copy {d['copy_bw'] / 1e9:.0f} GB/s; "
                            f"ratio {r['absorbed_ratio']:.3f}", ">= 0.5", r["absorbed_ratio"] >= 0.5, src))
    return rows


CHECKS = [("hybrid", issue16_deferral), ("hybrid", issue16_hybrid), ("int4", lambda d, s: issue16_cpu(d, s, "AMXINT4")),
          ("int8", lambda d, s: issue16_cpu(d, s, "AMXINT8")), ("serving", issue16_serving), ("decode", issue16_decode),
          ("ab_decode", issue16_ab_decode),
          ("gguf", issue18_gguf), ("gguf_large", issue18_gguf), ("hybrid_gguf", issue18_hybrid), ("mla", issue15_mla)]


def tables(out: Path, files: dict[str, Path] | None = None, bad: list[str] | None = None) -> list[Row]:
    """Every row whose file is there (files: key -> path, over FILES in `out`). A file that is not JSON of the
    script's shape (truncated, another script's) gives no rows and one line in `bad`."""
    paths = {k: out / name for k, name in FILES.items()} | (files or {})
    rows: list[Row] = []
    for key, check in CHECKS:
        p = paths[key]
        if not p.is_file():
            continue
        try:
            rows += check(json.loads(p.read_text()), p.name)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            if bad is not None:
                bad.append(f"{p}: not a {key} result file ({type(e).__name__}: {e})")
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| issue | point | what | value | ceiling / ratio | target | met | file |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(f"| {r.issue} | {r.point} | {r.what} | {r.value:.3f} {r.unit} | {r.ceiling} | {r.target} | {met} "
                     f"| {r.source} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the folder of the run's JSON files")
    p.add_argument("--file", action="append", default=[], metavar="KEY=PATH",
                   help=f"another file for a key ({', '.join(FILES)})")
    p.add_argument("--device", default="", help="the machine, for the header")
    p.add_argument("--commit", default="", help="the commit the run was on, for the header")
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    files = {}
    for spec in a.file:
        key, _, path = spec.partition("=")
        if key not in FILES or not path:
            p.error(f"--file {spec!r}: expected KEY=PATH with KEY one of {', '.join(FILES)}")
        files[key] = Path(path)
    bad: list[str] = []
    rows = tables(a.out, files, bad)
    for line in dict.fromkeys(bad):
        print(f"issue_tables: {line}", file=sys.stderr)
    if a.device or a.commit:
        print(f"device: {a.device or '?'}; commit: {a.commit or '?'}\n")
    print(markdown(rows) if rows else f"no known result file in {a.out}")
    if a.json:
        a.json.write_text(json.dumps({"device": a.device, "commit": a.commit, "rows": [asdict(r) for r in rows]},
                                     indent=2))
    return 2 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
