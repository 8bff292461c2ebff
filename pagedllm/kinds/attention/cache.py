"""What an attention layer keeps of a sequence: K and V of every token of its context, or of its
sliding window, in the paged blocks of that window's pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import PagedKV

if TYPE_CHECKING:
    from ...config import ModelConfig


def cache(cfg: ModelConfig, layer: int) -> PagedKV:
    window = cfg.sliding_windows[layer] if cfg.sliding_windows else None
    return PagedKV(window, cfg.num_kv_heads, cfg.head_dim)
