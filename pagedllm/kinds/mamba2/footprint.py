"""The memory of a Mamba-2 layer's phases in a step (``forward.Mamba2`` as it runs).

Above ``live``: the stacked projection's output (z, x/B/C, dt), then the scan's float32 work for
the largest share of the step one sequence can have (every token): its convolution window and
output, B and C repeated to the heads, x and dt x, the step sizes and decays, the output with D x,
and one chunk's matrices per head (``scan.CHUNK`` squared: the decay ratios, C B^T and their
product; the chunk's products with the state). The states themselves are the cache's
(``cache.py``), not the step's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .scan import CHUNK

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    cfg, t, e, live, g = layer.cfg, layer.t, layer.e, layer.live, layer.gemms
    m = cfg.mamba2
    assert m is not None
    h, heads, inner, channels = cfg.hidden_size, m.heads, m.inner, m.conv_channels
    width = inner + channels + heads
    projected = g.rows_of(t, h, width) * width * e
    window = channels * (m.conv_kernel - 1 + t) * 4
    convolved = 2 * t * channels * 4  # the convolution's output and its silu
    heads_bcx = t * heads * (2 * m.state_size + 2 * m.head_dim) * 4  # B and C repeated, x, dt x
    gates = 2 * t * heads * 4
    out = 2 * t * inner * 4  # the scan's output, then with D x
    chunk = min(t, CHUNK)
    matrices = heads * (chunk * (3 * chunk + 3 * max(m.state_size, m.head_dim)) + m.state_size * m.head_dim) * 4
    return {
        "mamba2 projections": live + g.bytes(t, h, width),
        "mamba2 scan": live + projected + gates + out + window + convolved + heads_bcx + matrices,
        "mamba2 gated norm": live + projected + t * inner * 4 * 3 + t * inner * e,
        "mamba2 output projection": live + t * inner * e + g.bytes(t, inner, h) + layer.allreduce,
        "residual add + norm": live + g.rows_of(t, inner, h) * h * e + t * h * e + layer.norm,
    }


def matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(rows, columns) of the stacked input projection (z, x/B/C, dt) and the output one."""
    m = cfg.mamba2
    assert m is not None
    return [(m.inner + m.conv_channels + m.heads, cfg.hidden_size), (cfg.hidden_size, m.inner)]


def parameters(cfg: ModelConfig, layer: int) -> int:
    """Its matrices (and their biases), the convolution's taps (and bias), each head's decay rate,
    step bias and D, the gated norm's scale."""
    m = cfg.mamba2
    assert m is not None
    n = sum(r * c for r, c in matrices(cfg, layer))
    biases = (m.inner + m.conv_channels + m.heads + cfg.hidden_size) * m.projection_bias
    return n + biases + m.conv_channels * (m.conv_kernel + m.conv_bias) + 3 * m.heads + m.inner
