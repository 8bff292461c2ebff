"""Every environment variable pagedllm reads, each named, typed, defaulted and explained once.

No other module reads ``os.environ`` for a setting (``tests/test_environment_switches.py``
checks): it asks a ``Var`` here. A variable is read when asked, not at import, so a shell, a
test or a parent process may set it at any time before the reading part starts; a value that
does not parse is an error naming the variable. ``python -m pagedllm.env`` prints the table.

Torch-free and import-free, so any stage may ask.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


def _flag(raw: str) -> bool:
    """0, false, no and off are off; anything else is on."""
    return raw.lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    meaning: str

    def get(self) -> T:
        """The value set (spaces around it dropped), or the default where it is unset or empty."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise ValueError(f"environment variable {self.name}={raw!r}: expected {self.meaning}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())


CACHE = Var("PAGEDLLM_CACHE", Path, Path.home() / ".cache" / "pagedllm", "a folder: converted models and built kernels")
API_KEY = Var("PAGEDLLM_API_KEY", str, "", "the key `pagedllm serve` asks clients for (--api-key wins)")
KERNELS = Var(
    "PAGEDLLM_KERNELS",
    str.lower,
    "auto",
    "auto, compiled or torch: build the C++ kernels if possible, require them, or never build them",
)
KERNEL_TARGET = Var(
    "PAGEDLLM_KERNEL_TARGET", str, "native", "the CPU the kernels are built for: native, x86-64-v3 or x86-64-v4"
)
COMPILER = Var("CXX", str, "c++", "the C++ compiler that builds the kernels")
DECODE_STEP = Var("PAGEDLLM_DECODE_STEP", _flag, True, "0 runs every step in the Python layer loop")
EXPERT_PREFETCH = Var(
    "PAGEDLLM_EXPERT_PREFETCH",
    _flag,
    False,
    "1 reads the next layer's likely experts ahead into an expert cache (guessed from this layer's "
    "input: it missed 93% of the time on the benchmark's model, docs/memory.md)",
)
THREADS = Var("PAGEDLLM_THREADS", int, 0, "a whole number: the most torch threads (0: one per physical core)")
PIN_THREADS = Var("PAGEDLLM_PIN_THREADS", _flag, True, "0 never pins threads to cores")
ADAPT_THREADS = Var("PAGEDLLM_ADAPT_THREADS", _flag, True, "0 keeps the thread count fixed beside busy processes")
CHECK_INVARIANTS = Var(
    "PAGEDLLM_CHECK_INVARIANTS", _flag, False, "1 checks the engine's bookkeeping after every step (the tests do)"
)
GROW_SETTLE_S = Var(
    "PAGEDLLM_GROW_SETTLE_S",
    float,
    10.0,
    "seconds a grown budget must hold before new requests are admitted into it",
)
FOLLOW_INTERVAL = Var("PAGEDLLM_FOLLOW_INTERVAL", float, 2.0, 'seconds between looks at the machine (memory="follow")')
FOLLOW_MARGIN = Var("PAGEDLLM_FOLLOW_MARGIN", float, 0.05, 'the share of the limit memory="follow" leaves free')
CGROUP_ROOT = Var("PAGEDLLM_CGROUP_ROOT", Path, Path("/sys/fs/cgroup"), "where the container's cgroup files are")
PSI_PATH = Var("PAGEDLLM_PSI_PATH", Path, Path("/proc/pressure/memory"), "the kernel's memory-pressure file")
TP_TIMEOUT = Var("PAGEDLLM_TP_TIMEOUT", float, 300.0, "seconds a rank of a split model waits for the others")
TP_SHM = Var("PAGEDLLM_TP_SHM", _flag, True, "0 sums a split model's ranks over gloo alone, not shared memory")
# Set by others, read by pagedllm.
ONEDNN_MAX_CPU_ISA = Var(
    "ONEDNN_MAX_CPU_ISA", str, "", "oneDNN's cap on the instructions it uses (pagedllm's AMX kernels obey it too)"
)
DNNL_MAX_CPU_ISA = Var("DNNL_MAX_CPU_ISA", str, "", "the old name of ONEDNN_MAX_CPU_ISA")
MKL_ENABLE_INSTRUCTIONS = Var(
    "MKL_ENABLE_INSTRUCTIONS", str, "", "MKL's cap on the instructions it uses (bench --matrix: a figure emulated)"
)
RANK = Var("RANK", int, -1, "a launcher's (torchrun) rank of this process")
WORLD_SIZE = Var("WORLD_SIZE", int, 0, "a launcher's count of ranks")
MASTER_ADDR = Var("MASTER_ADDR", str, "", "a launcher's address of rank 0")
LOCAL_RANK = Var("LOCAL_RANK", int, -1, "a launcher's rank of this process on its host")
LOCAL_WORLD_SIZE = Var("LOCAL_WORLD_SIZE", int, 0, "a launcher's count of ranks on this host")

ALL: tuple[Var, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Var))


def table() -> str:
    width = max(len(v.name) for v in ALL)
    return "\n".join(f"{v.name:<{width}}  {str(v.default) or '(unset)':<24}  {v.meaning}" for v in ALL)


if __name__ == "__main__":
    print(table())
