"""Packaging: triton only as an extra (torch's CUDA wheels bring it; the CPU wheel does not, and a CPU
install must work without it), uvicorn[standard], the Apache-2.0 LICENSE that pyproject declares."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# Run with triton unimportable (as on a CPU-only install): the package, the server entry points and a CPU
# generation must not need it.
NO_TRITON = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
sys.modules["xgrammar"] = None  # the `structured` extra (its Linux wheel requires triton)
import hybridmoe.check, hybridmoe.cli, hybridmoe.launch_server
from hybridmoe.engine.llm import LLM
llm = LLM(device="cpu", log_level="warning", kv_cache_dtype="fp8_e4m3")
out = llm.generate(prompt="The module", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
assert out["meta_info"]["completion_tokens"] == 3, out
# a grammar request: ends alone, its message naming the extra (the server answers it with a 400)
bad = llm.generate(prompt="x", sampling_params={"max_new_tokens": 3, "regex": "a+"})["meta_info"]["finish_reason"]
assert bad["type"] == "abort" and "hybridmoe[structured]" in bad["message"], bad
assert "triton" not in {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
print("OK")
"""


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_triton_is_an_extra_not_a_dependency() -> None:
    project = _project()
    # xgrammar too: its Linux wheel requires triton
    assert not [d for d in project["dependencies"] if d.startswith(("triton", "xgrammar"))]
    for extra in ("gpu", "test"):
        assert [d for d in project["optional-dependencies"][extra] if d.startswith("triton")], extra
    for extra in ("structured", "test"):
        assert [d for d in project["optional-dependencies"][extra] if d.startswith("xgrammar")], extra


def test_uvicorn_standard_and_hub() -> None:
    deps = _project()["dependencies"]
    assert any(d.startswith("uvicorn[standard]") for d in deps)
    assert any(d.startswith("huggingface-hub") for d in deps)


def test_license_file() -> None:
    assert _project()["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text


def test_cpu_install_runs_without_triton() -> None:
    if not (REPO / "hybridmoe" / "demo_model" / "config.json").is_file():
        pytest.skip("the demo model hybridmoe/demo_model is not built")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", NO_TRITON], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
