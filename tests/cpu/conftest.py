"""Fixtures for the CPU expert engine tests: a small shared pool and the ISA paths to test.

HYBRIDMOE_CPU_ISA=avx2|avx512|amx restricts the ISA-parametrized tests to that path; a path this
CPU lacks is skipped with the reason (the lead runs AVX-512 and AMX on the production host).
"""

import os

import pytest

from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUThreadPool

ALL_ISAS = ["avx2", "avx512", "amx"]


@pytest.fixture(scope="session")
def pool():
    p = CPUThreadPool(threads=int(os.environ.get("HYBRIDMOE_TEST_THREADS", "2")))
    yield p
    p.close()


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    forced = os.environ.get("HYBRIDMOE_CPU_ISA")
    if forced and forced != request.param:
        pytest.skip(f"HYBRIDMOE_CPU_ISA={forced} restricts the run to that path")
    why = native.isa_missing(request.param)
    if why:
        pytest.skip(f"ISA path {request.param} unavailable here: {why}")
    return request.param


@pytest.fixture(autouse=True)
def _forced_isa_present(request):
    """With HYBRIDMOE_CPU_ISA naming a path this CPU lacks, every layer construction raises (by
    design); skip the tests that rely on the default path instead of failing them."""
    forced = os.environ.get("HYBRIDMOE_CPU_ISA")
    if forced and "isa" not in request.fixturenames and request.node.name != "test_forced_isa_missing_is_a_clear_error":
        why = native.isa_missing(forced)
        if why:
            pytest.skip(f"HYBRIDMOE_CPU_ISA={forced} cannot run here: {why}")
