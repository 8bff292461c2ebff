"""The memory of a dense MLP's phases in a step (``forward.MLP`` as it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    """A dense SwiGLU (or GeGLU) MLP: gate and up from one stacked GEMM, their product, down."""
    t, e, live, g, h = layer.t, layer.e, layer.live, layer.gemms, layer.cfg.hidden_size
    i = layer.cfg.intermediate_size
    return {
        "mlp gate/up": live + g.bytes(t, h, 2 * i),
        "silu * up": live + g.rows_of(t, h, 2 * i) * 2 * i * e + t * i * e,
        "mlp down": live + t * i * e + g.bytes(t, i, h) + layer.allreduce,
    }
