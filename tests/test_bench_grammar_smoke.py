"""benchmarks/bench_grammar.py runs end to end on the CPU with a tiny model: the script the H200 runs is
not first exercised on the device. It checks the script (the grammar really constrains the timed steps,
the modes interleave, the summary is the median of the runs), not the numbers."""

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import xgrammar as xgr

from hybridmoe.engine.grammar import GrammarBackend

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_grammar import EOS, SCHEMA, synthetic_vocab  # noqa: E402


def run_or_dump(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """subprocess.run, but a child that outlives the timeout gets SIGABRT first: with PYTHONFAULTHANDLER its
    threads' Python stacks land in stderr, and the failure shows them (it ran ~5 s here and once hung in CI)."""
    child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGABRT)
        out, err = child.communicate()
        raise AssertionError(f"{cmd[1]} still ran after {timeout} s; its stacks:\n{err[-6000:]}\n{out[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


def test_bench_grammar_smoke(tmp_path):
    out = tmp_path / "g.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_grammar.py"), "--device", "cpu", "--layers", "1",
           "--experts", "4", "--topk", "2", "--hidden", "64", "--inter", "64", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "16", "--vocab", "300", "--batch", "1", "3", "--steps", "3", "--warm", "12",
           "--repeat", "3", "--prompt-len", "8", "--out", str(out)]
    proc = run_or_dump(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["runs"]
    # per repeat and batch both modes, the order alternating by repeat
    assert [(r["rep"], r["batch"], r["grammar"]) for r in rows] == [
        (rep, b, g) for rep in range(3) for b in (1, 3) for g in ((False, True) if rep % 2 == 0 else (True, False))]
    compiled = GrammarBackend.for_vocab(synthetic_vocab(300), [EOS], vocab_size=300).compile("json_schema",
                                                                                              json.dumps(SCHEMA))

    def fits(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    for r in rows:
        assert r["ms_per_step"] > 0 and r["finished_early"] == 0 and len(r["text"]) > 0, r
        if r["grammar"]:  # the timed steps were constrained: their text is a prefix of what the schema allows
            assert fits(r["text"]), r["text"]
    assert not all(fits(r["text"]) for r in rows if not r["grammar"])  # (a check that can fail)
    for e in res["summary"]:
        med = {g: statistics.median(r["ms_per_step"] for r in rows if r["batch"] == e["batch"] and r["grammar"] == g)
               for g in (False, True)}
        assert e["median_ms_none"] == med[False] and e["median_ms_grammar"] == med[True]
        assert abs(e["ratio"] - med[True] / med[False]) < 1e-12 and e["fill_us"] > 0
    assert "ratio" in proc.stdout
