"""Backends: the device an engine computes on, chosen once per engine (``EngineConfig.backend``).

One folder per device holds everything pagedllm knows of it (``cpu/``: its facts, its backends,
its attention, its KV cache, its threads, its compiled decode step); this module is the registry,
torch-free, so the planner asks it without loading anything:

- ``NAMES``: every backend name (``auto`` and each device's);
- ``resolve(name)``: the backend ``auto`` would run, from the environment alone;
- ``facts(name, dtype)``: what the memory planner must know of it (``PlanFacts``), torch-free;
- ``workspace(device)``: the device's workspace terms the footprint adds (its GEMMs' scratch);
- ``get(name)``: the backend itself (``base.Backend``), its kernels built or loaded.

The CPU's names: ``cpu-compiled`` (pagedllm's C++ kernels, with the PyTorch arithmetic for what
they do not cover), ``cpu-torch`` (plain PyTorch, the reference and the fallback without a C++
compiler), and ``auto`` (``PAGEDLLM_KERNELS`` decides: ``auto`` builds or loads the kernels and
falls back to ``cpu-torch`` with one log line if it cannot, ``compiled`` requires them, ``torch``
never builds them). A new device is one folder with the same five names and one line in
``DEVICES``; none but the CPU exists yet, and asking for ``cuda`` is an error that says so.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from . import cpu
from .facts import PlanFacts

if TYPE_CHECKING:
    from .base import Backend

DEVICES: tuple[ModuleType, ...] = (cpu,)  # each: NAMES, DEVICE, resolve_auto, facts, get, workspace
NAMES = ("auto", *(name for device in DEVICES for name in device.NAMES))


def _device_of(name: str) -> ModuleType:
    if name == "auto":
        return DEVICES[0]
    for device in DEVICES:
        if name in device.NAMES:
            return device
    if name.startswith("cuda"):
        raise ValueError("backend 'cuda': not implemented yet (the interface is pagedllm.backends.base.Backend)")
    raise ValueError(f"backend {name!r}: choose one of {', '.join(NAMES)}")


def resolve(name: str = "auto") -> str:
    """The backend ``name`` stands for, without building it (``auto``: what would run here)."""
    return _device_of(name).resolve_auto() if name == "auto" else name


def facts(name: str, dtype: str) -> PlanFacts:
    """What the planner must know of backend ``name`` at ``dtype``, without torch."""
    return _device_of(name).facts(resolve(name), dtype)


def workspace(device: str) -> ModuleType:
    """The device's workspace terms (``gemm_scratch``, ``kernel_scratch_bytes``, ``packs_weights``)."""
    for module in DEVICES:
        if module.DEVICE == device:
            return module.workspace
    raise ValueError(f"device {device!r}: none of {', '.join(m.DEVICE for m in DEVICES)}")


def get(name: str = "auto") -> Backend:
    """The backend called ``name`` (see the module docstring); ValueError for an unknown one."""
    return _device_of(name).get(name)


__all__ = ["DEVICES", "NAMES", "PlanFacts", "facts", "get", "resolve", "workspace"]
