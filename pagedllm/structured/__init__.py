"""Structured output: constraints compiled to grammars that mask each step's logits
(``grammars``). OpenAI's tool calls, a protocol built on these constraints, are the server's
(``pagedllm.server.tool_calls``)."""

from ..sizes import GRAMMAR_CACHE_BYTES
from .grammars import Grammars, Matcher, allowed_prefix, available

__all__ = ["GRAMMAR_CACHE_BYTES", "Grammars", "Matcher", "allowed_prefix", "available"]
