"""What a short-convolution layer keeps of a sequence: the last ``kernel - 1`` inputs of its
convolution, every hidden channel, float32."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import SequenceState

if TYPE_CHECKING:
    from ...config import ModelConfig


def cache(cfg: ModelConfig, layer: int) -> SequenceState:
    assert cfg.short_conv is not None, "a short_conv layer in a config without its kernel"
    return SequenceState((("conv", (cfg.hidden_size, cfg.short_conv.kernel - 1)),))
