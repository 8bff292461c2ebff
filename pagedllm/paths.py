"""Where pagedllm keeps what it makes once and reuses: converted GGUF models, built kernels."""

from __future__ import annotations

from pathlib import Path

from . import env


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE``, else ``~/.cache/pagedllm``."""
    return env.CACHE.get()
