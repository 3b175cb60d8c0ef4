"""`hybridmoe check` reports the machine and exits 0 where the server runs (here: CPU only)."""

from __future__ import annotations

import json

from hybridmoe.check import check_main


def test_check_report(capsys):
    assert check_main([]) == 0
    out = capsys.readouterr().out
    for word in ("CPU", "NUMA", "RAM", "AVX2", "AMX int8", "native CPU lib", "torch", "transformers",
                 "--kt-cpuinfer", "--kt-threadpool-count", "--kt-method"):
        assert word in out, word
    assert check_main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cpu = report["cpu"]
    assert report["recommended_flags"]["--kt-cpuinfer"] == max(1, cpu["physical_cores"] - 1)
    assert report["recommended_flags"]["--kt-threadpool-count"] == cpu["numa_nodes"] >= 1


def test_check_fails_with_reason(monkeypatch, capsys):
    import hybridmoe.check as check

    monkeypatch.setattr(check, "REQUIRED_MODULES", check.REQUIRED_MODULES + ("no_such_module_xyz",))
    assert check.check_main([]) == 1
    assert "no_such_module_xyz" in capsys.readouterr().out
