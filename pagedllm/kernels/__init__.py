"""pagedllm's compiled CPU kernels (``csrc/``), built on first use into the cache.

The layers ask ``compiled_ops()`` for them and run their pure-PyTorch code when it returns None.
``PAGEDLLM_KERNELS`` chooses: ``auto`` (default: build or load the kernels; without a compiler,
the PyTorch path, with one log line), ``compiled`` (the kernels or an error), ``torch`` (never
build). ``select`` does the same from code (the tests run both paths).
"""

from .build import MODES, compiled_ops, select

__all__ = ["MODES", "compiled_ops", "select"]
