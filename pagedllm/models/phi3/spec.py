"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): Llama's layers, with q/k/v in one checkpoint
tensor (``self_attn.qkv_proj``) and gate/up in another (``mlp.gate_up_proj``, gate first), a
sliding window on every layer where the config sets one, and LongRoPE (short and long factors
per rotary pair; ``layers/rotary.py``) on the long-context models. ``unfuse`` splits the fused
tensors by rows into the roles the decoder stacks again. Phi-4-mini's rotary positions on part
of each head (``partial_rotary_factor``) are refused by the config reader.

llama.cpp writes its GGUF files as ``phi3`` with the same fused tensors (``attn_qkv``, and
``ffn_up`` holding gate then up), q/k rows as HF keeps them, the LongRoPE factors as two tensors
and the sliding window in its metadata (0: none, Phi-4)."""

from __future__ import annotations

from ..family import Family


def unfuse(name: str, tensor, cfg) -> list[tuple[str, object]] | None:
    """q, k and v (or gate and up) of a fused tensor, by rows; None for any other tensor."""
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith("self_attn.qkv_proj"):
        base = prefix.removesuffix("qkv_proj")
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bounds = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        return [(f"{base}{part}.{leaf}", tensor[lo:hi]) for part, (lo, hi) in bounds.items()]
    if prefix.endswith("mlp.gate_up_proj"):
        base, width = prefix.removesuffix("gate_up_proj"), tensor.shape[0] // 2
        return [(f"{base}gate_proj.{leaf}", tensor[:width]), (f"{base}up_proj.{leaf}", tensor[width:])]
    return None


ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def gguf_config(get, tensor) -> dict:
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = hidden // heads
    config: dict = {"sliding_window": int(get("attention.sliding_window", 0)) or None}
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim:  # refused by name by the config reader
        config["partial_rotary_factor"] = rotary / head_dim
    short, long = (tensor(name) for name in ROPE_FACTORS)
    if long is not None:
        config["rope_parameters"] = {
            "rope_type": "longrope",
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "short_factor": short,
            "long_factor": long,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
    return config


FAMILY = Family(
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    gguf_architecture="phi3",
    sliding="every layer",
    unfuse=unfuse,
    gguf_config=gguf_config,
    gguf_config_tensors=ROPE_FACTORS,
    gguf_fused={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)
