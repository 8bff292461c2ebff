"""Where pagedllm keeps what it makes once and reuses: converted GGUF models, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE``, else ``~/.cache/pagedllm``."""
    return Path(os.environ.get("PAGEDLLM_CACHE") or Path.home() / ".cache" / "pagedllm")
