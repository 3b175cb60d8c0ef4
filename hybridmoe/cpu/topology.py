"""CPU topology from Linux sysfs (no NUMA library): usable physical cores and their NUMA nodes."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

SYS = Path("/sys/devices/system")


def _parse_list(text: str) -> list[int]:
    out = []
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


@lru_cache(maxsize=1)
def numa_nodes() -> dict[int, list[int]]:
    """node id -> its CPUs (all CPUs on node 0 when sysfs has no node directory)."""
    nodes = {}
    for d in sorted((SYS / "node").glob("node[0-9]*")):
        try:
            nodes[int(d.name[4:])] = _parse_list((d / "cpulist").read_text())
        except (OSError, ValueError):
            pass
    return nodes or {0: sorted(os.sched_getaffinity(0))}


@lru_cache(maxsize=1)
def physical_cores() -> list[int]:
    """One allowed logical CPU per physical core (the first SMT sibling), in CPU order."""
    allowed = sorted(os.sched_getaffinity(0))
    seen, cores = set(), []
    for cpu in allowed:
        base = SYS / "cpu" / f"cpu{cpu}" / "topology"
        try:
            key = ((base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))
        if key not in seen:
            seen.add(key)
            cores.append(cpu)
    return cores


def node_of(cpu: int) -> int:
    for node, cpus in numa_nodes().items():
        if cpu in cpus:
            return node
    return 0


def default_threads() -> int:
    """Physical cores minus one (the GPU-driving thread keeps a core); at least 1."""
    return max(1, len(physical_cores()) - 1)


def parse_node_list(text: str) -> list[int]:
    """"0,1" or "0-1" -> [0, 1] (--kt-numa-nodes); ValueError on anything else."""
    nodes = _parse_list(text.replace(" ", ""))
    if not nodes:
        raise ValueError("empty node list")
    return sorted(set(nodes))


def plan_threads(threads: int | None, subpools: int = 1, nodes: list[int] | None = None) -> tuple[list[int], int]:
    """CPUs to pin `threads` workers to, grouped so sub-pool s gets cores of NUMA node s when the
    machine has at least `subpools` nodes. `nodes` (--kt-numa-nodes) restricts the workers to the
    cores of those nodes, with one sub-pool per node at least. Returns (cpu per thread, sub-pool count)."""
    cores = physical_cores()
    if nodes is not None:
        present = numa_nodes()
        missing = [n for n in nodes if n not in present]
        if missing:
            raise ValueError(f"--kt-numa-nodes: node(s) {missing} not on this machine (NUMA nodes: {sorted(present)})")
        cores = [c for c in cores if node_of(c) in nodes]
        if not cores:
            raise ValueError(f"--kt-numa-nodes: no usable core on node(s) {nodes} (CPU affinity of this process)")
        subpools = max(subpools or 1, len(nodes))
        if threads is None:  # the GPU-driving thread keeps a core when the pool would take them all
            threads = max(1, len(cores) - (1 if len(cores) == len(physical_cores()) else 0))
    n = threads or default_threads()
    subpools = max(1, min(subpools or 1, n))
    by_node: dict[int, list[int]] = {}
    for c in cores:
        by_node.setdefault(node_of(c), []).append(c)
    if subpools > 1 and len(by_node) >= subpools:
        nodes = sorted(by_node)[:subpools]
        cpus = []
        for s, node in enumerate(nodes):  # sub-pool s = threads [ceil(s*n/k), ceil((s+1)*n/k)) as in C++
            share = -(-n * (s + 1) // subpools) - -(-n * s // subpools)
            pool = by_node[node]
            cpus += [pool[j % len(pool)] for j in range(share)]
        return cpus, subpools
    if n > len(cores):  # more threads than cores: use the SMT siblings too, then wrap around
        allowed = sorted(os.sched_getaffinity(0))
        extra = [c for c in allowed if c not in cores]
        cores = cores + extra
    return [cores[j % len(cores)] for j in range(n)], subpools


def numa_nodes_problem(spec: str) -> str | None:
    """What is wrong with a --kt-numa-nodes value ("0" or "0,1"), or None when every node exists here."""
    try:
        nodes = parse_node_list(spec)
    except ValueError:
        return "NUMA node ids like 0 or 0,1"
    present = sorted(numa_nodes())
    return None if all(n in present for n in nodes) else f"nodes of this machine: {present}"
