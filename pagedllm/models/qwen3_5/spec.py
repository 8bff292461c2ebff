"""Qwen3.5/3.6 (text): three of every four layers are Gated DeltaNet (``kinds/gated_deltanet``: a
linear attention with a fixed state per sequence), the fourth full attention whose q projection
carries an output gate per head and whose rotary turns a quarter of each head; q and k RMS-normed
per head. Every RMSNorm but the delta rule's gated one scales by (1 + weight) (zero-centred): the
loader adds the 1 once, as for Gemma. The multi-token-prediction head (``mtp.*``) is skipped.

Not yet: GGUF files (``qwen35``), a split over ranks, speculative decoding, and
compiled kernels for the delta rule (the PyTorch path runs)."""

from ..family import DENSE_LAYER_NAMES, Family

# the Gated DeltaNet layers' tensors, by the roles ``kinds.gated_deltanet`` gives them
DELTA_RULE_NAMES = {
    "linear_qkv": "linear_attn.in_proj_qkv",
    "linear_z": "linear_attn.in_proj_z",
    "linear_b": "linear_attn.in_proj_b",
    "linear_a": "linear_attn.in_proj_a",
    "linear_out": "linear_attn.out_proj",
}

FAMILY = Family(
    architecture="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    qk_norm="head",
    layer_names={**DENSE_LAYER_NAMES, **DELTA_RULE_NAMES},
    norm_weight_offset=1.0,
    layer_type_mixers={"linear_attention": "gated_deltanet", "full_attention": "attention"},
    partial_rotary=True,
    attention_output_gate=True,
    skipped_prefixes=("mtp.",),
)
