"""Running a test file's Triton kernels under the Triton interpreter on the CPU, in a subprocess.

TRITON_INTERPRET must be set before triton is imported, and other tests in the same pytest process
may import triton first, so a test file runs itself as a script in a subprocess with the variable set.
Two forms, by what the script prints:
- lines: one "ok   ..." / "FAIL ..." line a case (`report`, `run_seeded_cases`, `script_main`), exit
  status 1 on any failure; the parent test asserts the status (`assert_interpreted`).
- json: one JSON object {case: result} as the last line (`collect`); the parent test reads it once
  (`json_results`) and checks each case in its own test (`case_result`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _patch_nested_calls_once() -> None:
    """Speeds the interpreter up without changing what it computes: it patches triton.language again for every
    call of a @triton.jit helper inside a kernel (tl.sum, tl.max and our own helpers: ~2-3 ms a call, a third of
    some scripts' time). Within one kernel launch a second patch of the same language modules finds them patched
    already and changes nothing, so it is skipped; each launch still patches as before. Leaves triton alone where
    its interpreter lacks the two names this relies on."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ti

    if not (callable(getattr(ti, "_patch_lang", None)) and hasattr(ti, "_LangPatchScope")
            and isinstance(getattr(ti, "GridExecutor", None), type)):
        return
    patch_lang, grid_call = ti._patch_lang, ti.GridExecutor.__call__
    patched: set[frozenset[int]] = set()  # language modules patched in the running launch
    depth = 0

    def once(fn):
        key = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if depth and key in patched:
            return ti._LangPatchScope()  # nothing to restore: the launch's own scope restores the language
        scope = patch_lang(fn)
        if depth:
            patched.add(key)
        return scope

    def launch(self, *args, **kwargs):
        nonlocal depth
        depth += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            depth -= 1
            if not depth:
                patched.clear()

    ti._patch_lang = once
    ti.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _patch_nested_calls_once()
    except ImportError:  # no triton: the scripts skip
        pass


def run_interpreted(script: str | Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python script args...` with TRITON_INTERPRET=1 and the repository first on PYTHONPATH."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(Path(script).resolve()), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def assert_interpreted(script: str | Path, group: str) -> None:
    """Runs one group of a lines-form script; prints its report and fails when the script did."""
    proc = run_interpreted(script, group)
    print(proc.stdout)
    assert proc.returncode == 0, f"interpreter run of {group} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


def report(ok: bool, msg: str, failures: list[str]) -> None:
    """Prints a case's line; appends msg to failures when it failed."""
    print(("ok   " if ok else "FAIL ") + msg, flush=True)
    if not ok:
        failures.append(msg)


def run_seeded_cases(group: str, cases: Iterable[tuple], dtypes: Iterable[str], dtype_of: dict[str, torch.dtype],
                     tol: dict[torch.dtype, float], run_case: Callable[..., float], device: str,
                     seeds: tuple[int, ...] = (0, 1)) -> list[str]:
    """Every case in every dtype with each seed (0 and 1 by default): run_case(case, dtype, device, seed) returns a
    relative error, checked against tol[dtype]. An exception fails its case only. Returns the failure messages."""
    failures: list[str] = []
    cases = list(cases)
    for dt in dtypes:
        dtype = dtype_of[dt]
        for case in cases:
            for seed in seeds:
                try:
                    err = run_case(case, dtype, device, seed)
                    ok = err <= tol[dtype]
                    msg = f"{group} {dt} {case[0]} seed={seed}: rel err {err:.2e} (tol {tol[dtype]:.0e})"
                except Exception as e:  # report every case, not only the first failure
                    ok, msg = False, f"{group} {dt} {case[0]} seed={seed}: {type(e).__name__}: {e}"
                report(ok, msg, failures)
    return failures


def script_main(groups: Iterable[str], run_group: Callable[[str, str], list[str]]) -> None:
    """A lines-form script's entry point: the groups named in argv (default all) on the CPU; exits 1 on a failure."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 (before triton is imported)"
    sys.path.insert(0, str(REPO))
    bad = [f for g in (sys.argv[1:] or sorted(groups)) for f in run_group(g, "cpu")]
    sys.exit(1 if bad else 0)


def collect(cases: dict[str, Callable[[], dict]], results: dict | None = None) -> dict:
    """{name: fn()} for a json-form script; an exception becomes that case's {"error": ...} (reported per case)."""
    results = {} if results is None else results
    for name, fn in cases.items():
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    return results


def json_results(script: str | Path) -> dict:
    """The JSON object a json-form script prints last, run with --interp under the interpreter."""
    proc = run_interpreted(script, "--interp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case_result(results: dict, name: str) -> dict:
    """One case's result: skips the test where the script reported `_skip`, fails it on an error."""
    if "_skip" in results:
        pytest.skip(results["_skip"])
    res = results[name]
    assert "error" not in res, res.get("error")
    return res
