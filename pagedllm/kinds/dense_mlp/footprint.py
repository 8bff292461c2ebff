"""The memory of a dense MLP's phases in a step (``forward.MLP`` as it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import ModelConfig
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


def matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(rows, columns) of gate/up (stacked) and down."""
    return [(2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]


def parameters(cfg: ModelConfig, layer: int) -> int:
    return sum(r * c for r, c in matrices(cfg, layer)) + (2 * cfg.intermediate_size + cfg.hidden_size) * cfg.mlp_bias
