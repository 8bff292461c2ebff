"""Layer kinds: what each decoder layer is made of, and what it keeps of a sequence between steps.

A decoder layer is a token mixer followed by a feed-forward, each after its norm. Each layer's
``LayerKind`` names both (``mixer``, ``feed_forward``: the keys of ``models.decoder``'s
``MIXERS`` and ``FEED_FORWARDS``, which build their modules) and declares its cache:

- ``PagedKV``: K and V for every token of the context (or of its sliding window) in the paged
  blocks of the pool of its window (``ModelConfig.kv_pools``); its bytes per token;
- ``SequenceState``: a fixed state per running sequence whatever its length (what a recurrent
  mixer keeps: a convolution's last inputs, a delta rule's or an SSM's state); its bytes.

The planner sums the caches' terms (``memory.footprint.kv_bytes_per_block`` per pool,
``state_bytes_per_sequence`` per running sequence) and never asks which kind a layer is, so a
new kind (next round: Gated DeltaNet, short convolutions, Mamba-2) is its spec here, its module
and one registry line in ``models/decoder.py``, and its kernels. Torch-free: ``pagedllm plan``
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sizes import KV_SCALE_BYTES, kv_element_bytes, kv_is_quantized


@dataclass(frozen=True)
class PagedKV:
    """K and V per token in the blocks of the pool of ``window`` (None: every token of the context)."""

    window: int | None
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, kv_dtype: str) -> int:
        """K and V of one token in every KV head (an 8-bit cache keeps a float32 scale per token and head)."""
        per_head = self.head_dim * kv_element_bytes(kv_dtype) + (KV_SCALE_BYTES if kv_is_quantized(kv_dtype) else 0)
        return 2 * self.kv_heads * per_head


@dataclass(frozen=True)
class SequenceState:
    """A fixed state per running sequence, ``bytes`` of it, whatever the sequence's length."""

    bytes: int


@dataclass(frozen=True)
class LayerKind:
    mixer: str  # "attention" (full or sliding: its cache says)
    feed_forward: str  # "dense" (an MLP) or "sparse" (a mixture of experts)
    cache: PagedKV | SequenceState
