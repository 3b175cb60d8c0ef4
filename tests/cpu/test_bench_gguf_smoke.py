"""benchmarks/bench_gguf_moe.py runs end to end on tiny shapes (the script the H200 runs is not first exercised
there): every type x T x prefetch distance gives a row with a positive rate. It checks the script, not the numbers."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_gguf_moe_smoke(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gguf_moe

    res = bench_gguf_moe.main(["--types", "Q4_K,Q8_0", "--E", "8", "--H", "256", "--I", "256", "--T", "1,3",
                               "--layers", "2", "--seconds", "0.05", "--min-iters", "2", "--prefetch", "0,1024",
                               "--rounds", "2", "--threads", "1", "--stream-bytes", str(1 << 24),
                               "--json", str(tmp_path / "g.json")])
    got = [(r["type"], r["T"], r["prefetch"], r["round"]) for r in res["rows"]]
    assert sorted(got) == sorted((ty, t, pf, k) for ty in ("Q4_K", "Q8_0") for t in (1, 3) for pf in (0, 1024)
                                 for k in (0, 1))
    assert [r["prefetch"] for r in res["rows"]][::4] == [0, 1024, 1024, 0]  # each round's order rotated
    assert all(r["GB/s"] > 0 and r["ratio_to_stream"] > 0 and r["ratio_to_adjacent"] > 0 for r in res["rows"])
    assert (tmp_path / "g.json").exists() and len(res["probes"]) == 1 + 2 * 2 * 2  # first, then after each T
    summary = {(s["type"], s["T"], s["prefetch"]): s for s in res["summary"]}
    assert len(summary) == 8 and all(s["rounds"] == 2 for s in summary.values())
    assert all(summary[(ty, t, 0)]["vs_first"] == 1.0 for ty in ("Q4_K", "Q8_0") for t in (1, 3))
    # --fuse: every row in each mode in turn, the summary per mode
    res = bench_gguf_moe.main(["--types", "Q4_K", "--E", "8", "--H", "256", "--I", "256", "--T", "1", "--layers", "1",
                               "--seconds", "0.05", "--min-iters", "2", "--threads", "1", "--stream-bytes",
                               str(1 << 24), "--fuse", "on,nochain"])
    assert [(r["fuse"], r["T"]) for r in res["rows"]] == [("on", 1), ("nochain", 1)]
    assert sorted(s["fuse"] for s in res["summary"]) == ["nochain", "on"]
    # `default` is the engine's own distance on this host, recorded in the file; duplicates run once
    from hybridmoe.cpu.engine import CPUEngineSettings

    pf = CPUEngineSettings().prefetch_bytes
    res = bench_gguf_moe.main(["--types", "Q4_K", "--E", "8", "--H", "256", "--I", "256", "--T", "1", "--layers", "1",
                               "--seconds", "0.05", "--min-iters", "2", "--threads", "1", "--stream-bytes",
                               str(1 << 24), "--prefetch", f"default,{pf},1024"])
    assert res["prefetch_bytes_default"] == pf
    assert [r["prefetch"] for r in res["rows"]] == list(dict.fromkeys([pf, 1024]))


def test_bench_gguf_moe_bad_rounds_is_a_usage_error(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gguf_moe

    with pytest.raises(SystemExit) as e:
        bench_gguf_moe.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_gguf_moe.main(["--prefetch", "default,4k"])
    assert e.value.code == 2 and "--prefetch default,4k" in capsys.readouterr().err
