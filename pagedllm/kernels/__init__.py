"""pagedllm's compiled CPU kernels (``csrc/``), built on first use into the cache.

The ``cpu-compiled`` backend (``pagedllm.backends``) is their only user: it loads them once and
routes each op to them, or to the PyTorch arithmetic where they lack a case. ``PAGEDLLM_KERNELS``
chooses what backend ``auto`` means: ``auto`` (default: build or load the kernels; without a
compiler, the PyTorch path, with one log line), ``compiled`` (the kernels or an error), ``torch``
(never build). ``select`` does the same from code (the tests run both paths).
"""

from typing import Any

from . import build
from .build import MODES, KernelBuildError, compiled_ops, select


def kernels_mode() -> str:
    """What ``PAGEDLLM_KERNELS`` (or the last ``select``) asks for: auto, compiled or torch."""
    return build._mode()


def required_ops() -> Any:
    """The kernels, built or loaded now; KernelBuildError if they cannot be built here."""
    return build.required_ops()


__all__ = ["MODES", "KernelBuildError", "compiled_ops", "kernels_mode", "required_ops", "select"]
