"""Layer kinds: what each decoder layer is made of, one folder per kind, and this registry.

A decoder layer is a token mixer followed by a feed-forward, each after its norm. Each layer's
``LayerKind`` names both (a key of ``MIXERS`` and of ``FEED_FORWARDS``, each a folder here) and
declares its cache:

- ``PagedKV``: K and V for every token of the context (or of its sliding window) in the paged
  blocks of the pool of its window (``ModelConfig.kv_pools``); its bytes per token;
- ``SequenceState``: a fixed state per running sequence whatever its length (what a recurrent
  mixer keeps: a convolution's last inputs, a delta rule's or an SSM's state); its bytes.

A kind's folder holds everything the engine asks of it, one file per stage of the data path:

- ``cache.py`` (mixers): ``cache(cfg, layer)``, the layer's ``PagedKV`` or ``SequenceState``.
  Torch-free: ``ModelConfig.layer_kinds`` and ``pagedllm plan`` read it.
- ``forward.py``: ``build(cfg, layer, backend)``, the layer part's ``nn.Module`` (its forward).
- ``footprint.py``: ``phases(layer)``, the peak live bytes of each phase the part runs in a step
  (``memory.footprint.LayerTerms``: the step's sizes and the device's terms).

The planner sums the caches' terms (``memory.footprint.kv_bytes_per_block`` per pool,
``state_bytes_per_sequence`` per running sequence) and the parts' phases, and never asks which
kind a layer is. A new kind (Gated DeltaNet, short convolutions and Mamba-2 came so) is its
folder and one line here, and its kernels behind the device (which kinds a device's compiled
decode step runs is the device's list: ``backends/cpu/decode_program.PROGRAMMED_KINDS``).

``part`` imports a kind's file when first asked: the torch-free planner reads caches and
footprints and never loads a forward. Each file sits at its stage's level of the import graph
(``tests/test_architecture.py``), whatever folder it is in.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import ModuleType

from ..sizes import KV_SCALE_BYTES, kv_element_bytes, kv_is_quantized

# The kinds, each a folder of this package: a new kind is one line here.
# full or sliding attention (its cache says which); a gated delta rule (Qwen3.5); a gated short
# convolution (LFM2); a selective state space (Granite-4.0-H)
MIXERS = ("attention", "gated_deltanet", "short_conv", "mamba2")
FEED_FORWARDS = ("dense_mlp", "sparse_moe")  # a SwiGLU MLP; a mixture of such experts
PARTS = {"cache": MIXERS, "forward": MIXERS + FEED_FORWARDS, "footprint": MIXERS + FEED_FORWARDS}


def part(kind: str, name: str) -> ModuleType:
    """The kind's file ``name`` ("cache", "forward", "footprint"), imported on first ask."""
    if kind not in PARTS[name]:
        raise KeyError(f"no layer kind {kind!r} with a {name} (kinds: {', '.join(PARTS[name])})")
    return importlib.import_module(f"{__name__}.{kind}.{name}")


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
    """A fixed state per running sequence whatever its length: float32 tensors by name and shape
    (a Gated DeltaNet's: its convolution's last inputs and its delta rule's matrices), one of
    each per state slot (``engine.block_pools``)."""

    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def bytes(self) -> int:
        return sum(4 * math.prod(shape) for _, shape in self.tensors)


@dataclass(frozen=True)
class LayerKind:
    mixer: str  # a key of MIXERS
    feed_forward: str  # a key of FEED_FORWARDS
    cache: PagedKV | SequenceState
