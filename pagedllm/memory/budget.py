"""The budget: a size the user gave (``sizes.parse_memory``), or a fraction of the memory free now
(host or container)."""

from __future__ import annotations

from ..sizes import GiB, parse_memory
from .follow import FOLLOW, MachineWatch


def free_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes free now, where that figure came from)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, "torch.cuda.mem_get_info"
    candidates = []
    host = _meminfo_available()
    if host is not None:
        candidates.append((host, "host MemAvailable"))
    cgroup = _cgroup_free()
    if cgroup is not None:
        candidates.append(cgroup)
    if not candidates:
        raise RuntimeError("cannot tell how much memory is free: no /proc/meminfo and no cgroup limit")
    return min(candidates)


def total_memory() -> int:
    """The most memory this process could ever have: the host's, or its container's limit if
    lower (the KV cache reserves room to grow to it, ``LLMEngine.set_memory``)."""
    limits = [v for v in (_meminfo("MemTotal"), _read_int("/sys/fs/cgroup/memory.max")) if v]
    return min(limits) if limits else 1 << 40


def _meminfo_available() -> int | None:
    return _meminfo("MemAvailable")


def _meminfo(field: str) -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return None if text in ("max", "") else int(text)


def _cgroup_free(root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """Container limit minus current usage: cgroup v2, else v1."""
    limit, usage = _read_int(f"{root}/memory.max"), _read_int(f"{root}/memory.current")
    if limit is not None and usage is not None:
        return max(0, limit - usage), "cgroup v2 memory.max - memory.current"
    limit, usage = _read_int(f"{root}/memory/memory.limit_in_bytes"), _read_int(f"{root}/memory/memory.usage_in_bytes")
    if limit is not None and usage is not None and limit < (1 << 60):
        return max(0, limit - usage), "cgroup v1 memory.limit_in_bytes - memory.usage_in_bytes"
    return None


def resolve_budget(
    memory: str | int | None, memory_fraction: float | None, device: str = "cpu", already_used: int = 0
) -> tuple[int, str]:
    """The engine's whole budget in bytes, and a phrase saying where it came from.

    ``already_used``: bytes the engine itself already holds (e.g. loaded weights), added back to
    the free figure so a fraction means a fraction of what was free before the engine started.
    """
    if memory is not None and memory_fraction is not None:
        raise ValueError("give memory or memory_fraction, not both")
    if memory == FOLLOW:
        from .machine import resident_bytes

        budget, why = MachineWatch.from_env().budget(resident_bytes()[0], total_memory())
        return budget, f"memory=follow: {why}"
    if memory is not None:
        return parse_memory(memory), f"memory={memory}"
    fraction = 0.9 if memory_fraction is None else memory_fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
    free, source = free_memory(device)
    free += already_used
    return int(free * fraction), f"{fraction:g} x {free / GiB:.2f} GiB free ({source})"
