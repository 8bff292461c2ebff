"""Structured output: constraints compiled to grammars that mask each step's logits
(``grammars``), and OpenAI tool calls on top of them (``tool_calls``)."""

from .grammars import GRAMMAR_CACHE_BYTES, Grammars, Matcher, available

__all__ = ["GRAMMAR_CACHE_BYTES", "Grammars", "Matcher", "available"]
