"""The memory of an attention layer's phases in a step (``forward.Attention`` as it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    """Attention as ``forward.Attention`` runs it: q/k/v from one stacked GEMM, q and k
    normed (Qwen3, OLMoE) and rotated, attention over the paged cache, the output projection,
    then the residual add and the next norm."""
    cfg, s, t, e, live, g = layer.cfg, layer.s, layer.t, layer.e, layer.live, layer.gemms
    dev, d = layer.dev, cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    windowed = any(w is not None for w in cfg.sliding_windows)
    qkv_out = g.rows_of(t, cfg.hidden_size, dq + 2 * dk) * (dq + 2 * dk) * e
    qkv = qkv_out + (t * (dq + dk) * e if cfg.qk_norm else 0)  # normed q and k: new tensors
    phases = {
        "q/k/v projections": live + g.bytes(t, cfg.hidden_size, dq + 2 * dk),
        "rotary": live + qkv + dev.rotary_transient(s, t, dq),
        "attention": live + qkv + t * dq * e + dev.attention_transient(cfg, s, layer.shape, windowed),
        "output projection": live + t * dq * e + g.bytes(t, dq, cfg.hidden_size) + layer.allreduce,
        "residual add + norm": live
        + g.rows_of(t, dq, cfg.hidden_size) * cfg.hidden_size * e
        + t * cfg.hidden_size * e
        + layer.norm,
    }
    if cfg.qk_norm:
        phases["q/k norm"] = live + qkv_out + dev.qk_norm_transient(cfg, s, t)
    return phases
