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


def test_check_names_the_stream_wait_where_there_is_a_gpu(monkeypatch, capsys):
    """With a CUDA GPU the report says how the hybrid stream will wait for the CPU experts
    (--hybrid-stream-wait auto): by memory operations where the driver has them, else host functions."""
    import hybridmoe.check as check

    for memops, want in ((True, "memory operations"), (False, "host functions")):
        monkeypatch.setattr(check, "gpu_info", lambda m=memops: {
            "cuda_build": "13.0", "available": True, "stream_memops": m,
            "devices": [{"name": "NVIDIA H200", "memory_gib": 139.8, "capability": "9.0"}]})
        check.check_main([])
        out = capsys.readouterr().out
        line = next(ln for ln in out.splitlines() if ln.startswith("CPU->GPU wait"))
        assert want in line, line
