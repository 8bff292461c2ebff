"""The host's CPUs as this process sees them: which it may run on, one per physical core, and
each one's NUMA node. Facts of the machine, not of a device: the CPU backend's thread governor
places a step's threads by them, and the driver of a split model deals its ranks the cores."""

from __future__ import annotations

import os
from pathlib import Path


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def physical_cores(cpus: list[int]) -> list[int]:
    """One CPU per physical core among ``cpus`` (hyper-threads of one core share its units)."""
    seen: set[str] = set()
    chosen = []
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = siblings.read_text().strip() if siblings.is_file() else str(cpu)
        if key not in seen:
            seen.add(key)
            chosen.append(cpu)
    return chosen


def numa_node(cpu: int) -> int:
    """The NUMA node ``cpu`` sits on (0 where the kernel says none)."""
    for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"):
        return int(entry.name[4:])
    return 0
