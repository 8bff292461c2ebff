"""Qwen3-Next (Qwen3-Next-80B-A3B's kind): Qwen3.5-MoE's layers (``models/qwen3_5_moe``: Gated
DeltaNet three layers in four, gated full attention the fourth, mixtures with a sigmoid-gated
shared expert), its checkpoint laid out otherwise: a delta-rule layer's q, k, v and z in one
tensor (``linear_attn.in_proj_qkvz``) and b and a in another (``in_proj_ba``), each interleaved
per key head ([q, k, v, z] of key head 0, then of key head 1 ...; [b, a] likewise), which
``unfuse`` splits by rows into the tensors Qwen3.5 keeps apart. Sparse layers every
``decoder_sparse_step`` but ``mlp_only_layers``, the top-k renormalised as ``norm_topk_prob`` says.

llama.cpp writes its GGUF files as ``qwen3next``: as Qwen3.5's ``qwen35moe`` (``models/qwen3_5``:
A_log as -exp(A_log), the convolution flattened, norms plus one) but with the value heads in the
checkpoint's order, q/k/v and z already apart (``attn_qkv``, ``attn_gate``), and b and a still
fused per key head (``ssm_ba``), which ``unfuse`` splits, quantized or not (a quantized tensor's
rows are whole rows of its format). Its converter writes only mixtures whose every layer is sparse.

Not yet: what Qwen3.5 has not."""

from __future__ import annotations

from dataclasses import replace

from ..family import VALUE_HEADS_TILED_KEY
from ..qwen3_5.spec import GGUF_UNDO
from ..qwen3_5.spec import gguf_config as qwen35_gguf_config
from ..qwen3_5_moe.spec import FAMILY as QWEN3_5_MOE

_FUSED = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")


def unfuse(name: str, tensor, cfg) -> list[tuple[str, object]] | None:
    """q/k/v, z, b and a of a delta-rule layer's fused tensors, each part's rows gathered from
    every key head's group in head order; None for any other tensor."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(_FUSED):
        return None
    rule = cfg.delta_rule
    per_key = rule.value_heads // rule.key_heads
    base = prefix.rpartition(".")[0]
    if prefix.endswith("in_proj_ba"):
        widths = {"in_proj_b": per_key, "in_proj_a": per_key}
    else:
        q, v = rule.key_head_dim, per_key * rule.value_head_dim
        widths = {"q": q, "k": q, "v": v, "in_proj_z": v}
    group = sum(widths.values())
    start = 0
    rows: dict[str, list[int]] = {}
    for part, width in widths.items():
        rows[part] = [head * group + start + i for head in range(rule.key_heads) for i in range(width)]
        start += width
    if "q" in rows:  # q, k and v stacked as Qwen3.5's in_proj_qkv (the convolution's channel order)
        rows = {"in_proj_qkv": rows.pop("q") + rows.pop("k") + rows.pop("v"), **rows}
    return [(f"{base}.{part}.{leaf}", tensor[index]) for part, index in rows.items()]


def gguf_config(get, tensor) -> dict:
    """Qwen3.5's reading of the metadata (``qwen3next`` writes the same keys); the value heads in
    the checkpoint's order (its converter regroups none)."""
    return {**qwen35_gguf_config(get, tensor), VALUE_HEADS_TILED_KEY: False}


assert QWEN3_5_MOE.experts is not None
FAMILY = replace(
    QWEN3_5_MOE,
    architecture="Qwen3NextForCausalLM",
    model_type="qwen3_next",
    gguf_architecture="qwen3next",
    gguf_config=gguf_config,
    gguf_undo=GGUF_UNDO,
    gguf_fused={"ssm_ba": "linear_attn.in_proj_ba"},  # split on loading, as from safetensors
    transformers_reads_gguf=False,
    experts=replace(QWEN3_5_MOE.experts, always_renormalise=False),  # norm_topk_prob, as its config says
    unfuse=unfuse,
)
