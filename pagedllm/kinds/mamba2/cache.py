"""What a Mamba-2 layer keeps of a sequence: the last ``conv_kernel - 1`` inputs of its
convolution (every x, B and C channel) and each head's state [state_size, head_dim], float32
(what the reference scans in; lower is not measured safe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import SequenceState

if TYPE_CHECKING:
    from ...config import ModelConfig


def cache(cfg: ModelConfig, layer: int) -> SequenceState:
    m = cfg.mamba2
    assert m is not None, "a mamba2 layer in a config without its sizes"
    return SequenceState(
        (
            ("conv", (m.conv_channels, m.conv_kernel - 1)),
            ("recurrent", (m.heads, m.state_size, m.head_dim)),
        )
    )
