"""pagedllm: LLM generation with continuous batching over a paged KV cache.

The heavy parts (torch, transformers) load on first use of ``LLM``/``SamplingParams``, so the
planner and the CLI's ``plan`` start instantly.
"""

from .errors import CacheDoesNotFitError, ModelLoadError, PagedLLMError, RequestRejected, UnsupportedModelError

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "ModelLoadError",
    "UnsupportedModelError",
    "PagedLLMError",
    "CacheDoesNotFitError",
    "RequestRejected",
]
__version__ = "0.1.0"

_LAZY = {"LLM": ".llm", "SamplingParams": ".sampling_params", "RequestOutput": ".outputs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
