"""The CPU as a device: everything pagedllm knows of it, in one folder.

- ``machine``: its facts, torch-free (the kind of bf16 GEMM kernel oneDNN runs, the ISA the
  kernels are built for, whether a compiler is here); ``workspace``: the sizes its kernels tile
  by and the scratch its GEMMs and kernels take, which the memory planner budgets (torch-free);
- ``torch_backend`` (``cpu-torch``: plain PyTorch, the reference) and ``compiled_backend``
  (``cpu-compiled``: the C++ kernels of ``pagedllm.kernels``);
- ``attention`` (paged attention and its metadata), ``kv_cache`` (the cache's layout and
  memory), ``decode_program`` (a decode step's layers in one compiled call), ``threads`` (count,
  pinning, stepping down beside busy processes), ``onednn_probe`` (which kernel oneDNN really ran).

This module stays torch-free: the registry (``pagedllm.backends``) asks it for names and facts
when planning, and imports the backends only when one is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..facts import PlanFacts
from . import machine, workspace

__all__ = ["DEVICE", "NAMES", "facts", "get", "machine", "resolve_auto", "workspace"]

if TYPE_CHECKING:
    from ..base import Backend

NAMES = ("cpu-compiled", "cpu-torch")
DEVICE = "cpu"


def resolve_auto() -> str:
    """What ``auto`` will run, without building anything: the compiled kernels where a C++
    compiler is here and ``PAGEDLLM_KERNELS`` does not say ``torch``."""
    return "cpu-compiled" if machine.expected_kernels() == "compiled" else "cpu-torch"


def facts(name: str, dtype: str) -> PlanFacts:
    """The planner's facts for backend ``name`` from the CPU's flags and the environment, without
    torch (``pagedllm plan``); a built backend measures them (``Backend.plan_facts``)."""
    kernels = "compiled" if name == "cpu-compiled" else "torch"
    isa = machine.gemm_isa()
    return PlanFacts(
        kernels=kernels,
        gemm_kind=isa,
        amx_tiles=kernels == "compiled" and isa == "amx",
        device=DEVICE,
        quant_float_max_rows=machine.kernel_float_max_rows(),
        own_int8_sums=kernels == "compiled" and machine.kernel_own_int8_sums(),
    )


def get(name: str) -> Backend:
    """The backend called ``name`` (``auto``: ``PAGEDLLM_KERNELS`` decides; the compiled kernels are
    built or loaded, and where they cannot be, ``cpu-torch`` runs with one log line)."""
    from ... import kernels

    if name == "auto":
        name = {"torch": "cpu-torch", "compiled": "cpu-compiled"}.get(kernels.kernels_mode(), "auto")
    if name == "cpu-torch":
        from .torch_backend import CPUTorchBackend

        return CPUTorchBackend()
    ops = kernels.required_ops() if name == "cpu-compiled" else kernels.compiled_ops()
    if ops is None:  # auto, and the kernels cannot be built here (compiled_ops logged why)
        from .torch_backend import CPUTorchBackend

        return CPUTorchBackend()
    from .compiled_backend import CPUCompiledBackend

    return CPUCompiledBackend(ops)
