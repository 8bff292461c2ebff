"""The memory of an attention layer's phases in a step (``forward.Attention`` as it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    """Attention as ``forward.Attention`` runs it: q/k/v from one stacked GEMM, q and k
    normed (Qwen3, OLMoE) and rotated, attention over the paged cache, the output projection,
    then the residual add and the next norm."""
    cfg, s, t, e, live, g = layer.cfg, layer.s, layer.t, layer.e, layer.live, layer.gemms
    dev, d = layer.dev, cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    gate = t * dq * e if cfg.attention_output_gate else 0  # Qwen3.5: q copied out of [q, gate] rows
    width = dq + 2 * dk + (dq if cfg.attention_output_gate else 0)
    windowed = any(w is not None for w in cfg.sliding_windows)
    qkv_out = g.rows_of(t, cfg.hidden_size, width) * width * e + gate
    qkv = qkv_out + (t * (dq + dk) * e if cfg.qk_norm else 0)  # normed q and k: new tensors
    partial = 2 * t * (dq + dk) * e if cfg.rotary_dim < d else 0  # the rotated parts, copied out and back
    phases = {
        "q/k/v projections": live + g.bytes(t, cfg.hidden_size, width),
        "rotary": live + qkv + partial + dev.rotary_transient(s, t, dq),
        "attention": live + qkv + t * dq * e + dev.attention_transient(cfg, s, layer.shape, windowed),
        "output projection": live
        + t * dq * e * (2 if gate else 1)
        + gate
        + g.bytes(t, dq, cfg.hidden_size)
        + layer.allreduce,
        "residual add + norm": live
        + g.rows_of(t, dq, cfg.hidden_size) * cfg.hidden_size * e
        + t * cfg.hidden_size * e
        + layer.norm,
    }
    if cfg.qk_norm:
        phases["q/k norm"] = live + qkv_out + dev.qk_norm_transient(cfg, s, t)
    return phases


def matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(rows, columns) of its stacked linear layers: q/k/v (Qwen3.5's q rows with their gates), o."""
    dq, dk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [((2 if cfg.attention_output_gate else 1) * dq + 2 * dk, cfg.hidden_size), (cfg.hidden_size, dq)]


def parameters(cfg: ModelConfig, layer: int) -> int:
    """Its matrices, biases, q/k norms and sinks."""
    d = cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    n = sum(r * c for r, c in matrices(cfg, layer))
    n += (dq + 2 * dk) * cfg.qkv_bias + cfg.hidden_size * cfg.o_bias
    n += ((dq + dk) if cfg.qk_norm_scope == "all" else 2 * d) * cfg.qk_norm
    return n + cfg.num_heads * cfg.attention_sinks
