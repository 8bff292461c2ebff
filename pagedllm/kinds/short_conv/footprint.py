"""The memory of a short-convolution layer's phases in a step (``forward.ShortConv`` as it runs):
the projection's B, C, x; then in float32 B * x, the convolution's window and output (every token
of the step in the worst case, one sequence), C times it; the output projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    cfg, t, e, live, g = layer.cfg, layer.t, layer.e, layer.live, layer.gemms
    h = cfg.hidden_size
    assert cfg.short_conv is not None
    projected = g.rows_of(t, h, 3 * h) * 3 * h * e
    work = 3 * t * h * 4 + h * (cfg.short_conv.kernel - 1 + t) * 4  # B * x, the output, C * it; the window
    return {
        "short-conv projection": live + g.bytes(t, h, 3 * h),
        "short convolution": live + projected + work,
        "short-conv output projection": live + t * h * e + g.bytes(t, h, h) + layer.allreduce,
        "residual add + norm": live + g.rows_of(t, h, h) * h * e + t * h * e + layer.norm,
    }


def matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(rows, columns) of the B/C/x projection and the output one."""
    return [(3 * cfg.hidden_size, cfg.hidden_size), (cfg.hidden_size, cfg.hidden_size)]


def parameters(cfg: ModelConfig, layer: int) -> int:
    """Its matrices, the convolution's taps, and their biases where it has them."""
    conv, h = cfg.short_conv, cfg.hidden_size
    assert conv is not None
    return sum(r * c for r, c in matrices(cfg, layer)) + h * conv.kernel + (3 * h + h + h) * conv.bias
