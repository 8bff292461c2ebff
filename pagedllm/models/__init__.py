"""Model code: pure tensor maths over a flat token batch; no scheduling, no cache bookkeeping.

``registry`` and each family's ``spec`` are torch-free (configs are read where no torch is
loaded); ``DecoderLM`` imports torch, so it is imported when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decoder import DecoderLM

__all__ = ["DecoderLM"]


def __getattr__(name: str):
    if name == "DecoderLM":
        from .decoder import DecoderLM

        return DecoderLM
    raise AttributeError(name)
