"""Model code: pure tensor maths over a flat token batch; no scheduling, no cache bookkeeping."""

from .decoder import DecoderLM

__all__ = ["DecoderLM"]
