"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): Llama's layers, with q/k/v in one checkpoint
tensor (``self_attn.qkv_proj``) and gate/up in another (``mlp.gate_up_proj``, gate first), a
sliding window on every layer where the config sets one, and LongRoPE (short and long factors
per rotary pair; ``layers/rotary.py``) on the long-context models. ``unfuse`` splits the fused
tensors by rows into the roles the decoder stacks again. Phi-4-mini's rotary positions on part
of each head (``partial_rotary_factor``) are refused by the config reader."""

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


FAMILY = Family(
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    gguf_architecture=None,  # its GGUF files ("phi3": fused tensors, rope factors as tensors) are not read yet
    sliding="every layer",
    unfuse=unfuse,
)
