"""Fixtures for the CPU expert engine tests: a small shared pool, the ISA paths to test, and the
small AMXINT8 layer the engine-contract tests share.

HYBRIDMOE_CPU_ISA=avx2|avx512|amx restricts the ISA-parametrized tests to that path; a path this
CPU lacks is skipped with the reason (the lead runs AVX-512 and AMX on the production host).
HYBRIDMOE_TEST_THREADS sets the shared pool's threads (hybridmoe/envs.py).
"""

from collections.abc import Callable

import pytest
import torch

from hybridmoe import envs
from hybridmoe.cpu import native
from hybridmoe.cpu.engine import CPUMoELayer, CPUThreadPool
from hybridmoe.cpu.quant import pack_layer

ALL_ISAS = ["avx2", "avx512", "amx"]
E, H, INTER, K = 8, 128, 64, 2  # the shared layer: experts, hidden, intermediate, top-k


@pytest.fixture(scope="session")
def pool():
    p = CPUThreadPool(threads=envs.threads_for_tests())
    yield p
    p.close()


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    forced = envs.cpu_isa()
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
    forced = envs.cpu_isa()
    if forced and "isa" not in request.fixturenames and request.node.name != "test_forced_isa_missing_is_a_clear_error":
        why = native.isa_missing(forced)
        if why:
            pytest.skip(f"HYBRIDMOE_CPU_ISA={forced} cannot run here: {why}")


@pytest.fixture(scope="session")
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2*INTER, H], down [E, H, INTER] of the shared layer."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * INTER, H, generator=g) / H**0.5, torch.randn(E, H, INTER, generator=g) / INTER**0.5


@pytest.fixture(scope="module")
def layer(weights, pool) -> CPUMoELayer:
    """The shared layer (AMXINT8) on the shared pool."""
    try:
        return CPUMoELayer(pack_layer(*weights, "AMXINT8"), pool=pool)
    except native.CpuIsaError as e:  # HYBRIDMOE_CPU_ISA forces a path this CPU lacks
        pytest.skip(str(e))


def _inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), torch.randint(0, E, (t, K), generator=g), torch.rand(t, K, generator=g)


@pytest.fixture
def inputs() -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """inputs(t, seed=0) -> x [t, H], topk ids [t, K], topk weights [t, K] for the shared layer."""
    return _inputs
