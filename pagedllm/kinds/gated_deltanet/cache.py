"""What a Gated DeltaNet layer keeps of a sequence: the last ``conv_kernel - 1`` inputs of its
convolution (every q/k/v channel) and the delta rule's state of each value head, float32 (what
the reference computes the rule in; lower is not measured safe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import SequenceState

if TYPE_CHECKING:
    from ...config import ModelConfig


def cache(cfg: ModelConfig, layer: int) -> SequenceState:
    rule = cfg.delta_rule
    assert rule is not None, "a gated_deltanet layer in a config without delta_rule sizes"
    return SequenceState(
        (
            ("conv", (rule.conv_channels, rule.conv_kernel - 1)),
            ("recurrent", (rule.value_heads, rule.key_head_dim, rule.value_head_dim)),
        )
    )
