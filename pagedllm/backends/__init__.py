"""Backends: the device an engine computes on, chosen once per engine (``EngineConfig.backend``).

- ``cpu-compiled``: pagedllm's C++ kernels (built on first use into the cache, ~15 s), with the
  PyTorch arithmetic for what they do not cover;
- ``cpu-torch``: plain PyTorch, the reference and the fallback without a C++ compiler;
- ``auto`` (default): ``PAGEDLLM_KERNELS`` decides as it always has: ``auto`` builds or loads
  the kernels and falls back to ``cpu-torch`` with one log line if it cannot, ``compiled``
  requires them, ``torch`` never builds them.

``base.Backend`` is the interface a ``cuda`` backend will implement; none exists yet, and asking
for one is an error that says so.
"""

from __future__ import annotations

from .base import Backend, PlanFacts

NAMES = ("auto", "cpu-compiled", "cpu-torch")


def get(name: str = "auto") -> Backend:
    """The backend called ``name`` (see the module docstring); ValueError for an unknown one."""
    from .. import kernels

    if name == "auto":
        name = {"torch": "cpu-torch", "compiled": "cpu-compiled"}.get(kernels.kernels_mode(), "auto")
    if name == "cpu-torch":
        from .cpu_torch import CPUTorchBackend

        return CPUTorchBackend()
    if name in ("cpu-compiled", "auto"):
        ops = kernels.required_ops() if name == "cpu-compiled" else kernels.compiled_ops()
        if ops is None:  # auto, and the kernels cannot be built here (compiled_ops logged why)
            from .cpu_torch import CPUTorchBackend

            return CPUTorchBackend()
        from .cpu_compiled import CPUCompiledBackend

        return CPUCompiledBackend(ops)
    if name.startswith("cuda"):
        raise ValueError("backend 'cuda': not implemented yet (the interface is pagedllm.backends.base.Backend)")
    raise ValueError(f"backend {name!r}: choose one of {', '.join(NAMES)}")


__all__ = ["NAMES", "Backend", "PlanFacts", "get"]
