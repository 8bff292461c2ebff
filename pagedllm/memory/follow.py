"""``memory="follow"``: a budget that tracks the machine instead of a number.

The budget is the container's limit (cgroup v2: the lower of ``memory.max`` and ``memory.high``;
v1: ``memory.limit_in_bytes``), or the host's memory where there is none, less a margin
(``PAGEDLLM_FOLLOW_MARGIN``, default 5%) for whatever else runs there. Under memory pressure
(``/proc/pressure/memory``: some task stalled on memory for ``PRESSURE_AVG10`` % or more of the
last 10 s) the engine gives back a tenth of what it holds, at every poll while the pressure lasts,
down to the smallest plan that fits. The engine polls every ``PAGEDLLM_FOLLOW_INTERVAL`` seconds
(default 2), between steps and while idle (``LLMEngine.follow_machine``), and moves to a new budget
with ``set_memory`` when it changed by more than 1% (16 MiB at least).

The paths are ``PAGEDLLM_CGROUP_ROOT`` (default ``/sys/fs/cgroup``) and ``PAGEDLLM_PSI_PATH``, so
a test can write the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import env

FOLLOW = "follow"
PRESSURE_AVG10 = 10.0  # percent: from here on the machine is short of memory
PRESSURE_KEEP = 0.9  # under pressure, the budget becomes this fraction of what the process holds
NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number for "no limit"


@dataclass(frozen=True)
class MachineWatch:
    cgroup_root: Path
    psi_path: Path
    margin: float
    interval_s: float

    @classmethod
    def from_env(cls) -> MachineWatch:
        return cls(env.CGROUP_ROOT.get(), env.PSI_PATH.get(), env.FOLLOW_MARGIN.get(), env.FOLLOW_INTERVAL.get())

    def limit(self) -> tuple[int, str] | None:
        """The container's memory limit and where it was read, or None without one."""
        v2 = [(v, name) for name in ("memory.max", "memory.high") if (v := _number(self.cgroup_root / name))]
        if v2:
            value, name = min(v2)
            return value, f"cgroup v2 {name}"
        v1 = _number(self.cgroup_root / "memory" / "memory.limit_in_bytes")
        if v1 and v1 < NO_LIMIT:
            return v1, "cgroup v1 memory.limit_in_bytes"
        return None

    def pressure(self) -> float | None:
        """The share of the last 10 s in which some task stalled on memory, in percent."""
        try:
            for line in self.psi_path.read_text().splitlines():
                fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
                if line.startswith("some") and "avg10" in fields:
                    return float(fields["avg10"])
        except (OSError, ValueError):
            return None
        return None

    def budget(self, resident: int, host_memory: int) -> tuple[int, str]:
        """The budget to run under now, and why: the limit less the margin, or under pressure a
        tenth less than the process holds (``resident``)."""
        limit, source = self.limit() or (host_memory, "host memory")
        budget, why = int(limit * (1 - self.margin)), f"{1 - self.margin:g} x {source}"
        pressure = self.pressure()
        if pressure is not None and pressure >= PRESSURE_AVG10 and resident * PRESSURE_KEEP < budget:
            budget, why = int(resident * PRESSURE_KEEP), f"memory pressure {pressure:g}%: {PRESSURE_KEEP:g} x resident"
        return budget, why


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit
