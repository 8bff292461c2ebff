"""The memory of a Gated DeltaNet layer's phases in a step (``forward.GatedDeltaNet`` as it runs).

Above ``live``: the stacked projection's output (q/k/v, z, b, a), then the rule's float32 work
for the largest share of the step one sequence can have (every token): its convolution window
and output, q and k repeated to the value heads and normalised, v, the decays and betas, the
output, and one chunk's matrices per head (``delta_rule.CHUNK`` squared: the decay ratios, the
system and its products). A decode group's gathers are the same per row, smaller. The states
themselves are the cache's (``cache.py``), not the step's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .delta_rule import CHUNK

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    cfg, t, e, live, g = layer.cfg, layer.t, layer.e, layer.live, layer.gemms
    rule = cfg.delta_rule
    assert rule is not None
    h, heads = cfg.hidden_size, rule.value_heads
    values, channels = heads * rule.value_head_dim, rule.conv_channels
    width = channels + values + 2 * heads
    projected = g.rows_of(t, h, width) * width * e
    window = channels * (rule.conv_kernel - 1 + t) * 4
    convolved = 2 * t * channels * 4  # the convolution's output and its silu
    heads_qkv = t * heads * (2 * rule.key_head_dim + rule.value_head_dim) * 4 * 2  # repeated, then normalised
    gates = 2 * t * heads * 4
    out = t * values * 4
    chunk = min(t, CHUNK)
    matrices = heads * chunk * (5 * chunk + 2 * max(rule.key_head_dim, rule.value_head_dim)) * 4
    return {
        "delta-rule projections": live + g.bytes(t, h, width),
        "delta rule": live + projected + gates + out + window + convolved + heads_qkv + matrices,
        "delta-rule gated norm": live + projected + out * 3 + t * values * e,
        "delta-rule output projection": live + t * values * e + g.bytes(t, values, h) + layer.allreduce,
        "residual add + norm": live + g.rows_of(t, values, h) * h * e + t * h * e + layer.norm,
    }


def matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(rows, columns) of the stacked input projection (q/k/v, z, b, a) and the output one."""
    rule = cfg.delta_rule
    assert rule is not None
    values = rule.value_heads * rule.value_head_dim
    return [(rule.conv_channels + values + 2 * rule.value_heads, cfg.hidden_size), (cfg.hidden_size, values)]


def parameters(cfg: ModelConfig, layer: int) -> int:
    """Its matrices, the convolution's taps, each value head's decay rate and step bias, the gated norm."""
    rule = cfg.delta_rule
    assert rule is not None
    n = sum(r * c for r, c in matrices(cfg, layer))
    return n + rule.conv_channels * rule.conv_kernel + 2 * rule.value_heads + rule.value_head_dim
