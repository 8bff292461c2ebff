"""Qwen3.5/3.6 (text): three of every four layers are Gated DeltaNet (``kinds/gated_deltanet``: a
linear attention with a fixed state per sequence), the fourth full attention whose q projection
carries an output gate per head and whose rotary turns a quarter of each head; q and k RMS-normed
per head. Every RMSNorm but the delta rule's gated one scales by (1 + weight) (zero-centred): the
loader adds the 1 once, as for Gemma. The multi-token-prediction head (``mtp.*``) is skipped.

llama.cpp writes its GGUF files as ``qwen35``: each delta-rule layer's q/k/v projection as
``attn_qkv``, z as ``attn_gate``, b and a as ``ssm_beta``/``ssm_alpha``, A_log as ``ssm_a``
holding -exp(A_log) (``gguf_undo`` takes the log back), dt_bias as ``ssm_dt.bias``, the
convolution [channels, taps] without its middle axis, the MLP's input norm as
``post_attention_norm``, and every norm but the gated one plus one (as Gemma's). Where there are
more value heads than key heads its converter regroups the value heads' rows (and out_proj's
columns) so that value head j is key head j mod key_heads's: the conversion says so in the
config (``linear_value_heads_tiled``) and the layer pairs the heads that way, the weights as the
file has them. Its rotary is "MRoPE" in sections, which for text (one position per token) is the
plain rotary. Multi-token-prediction layers in the file are skipped.

Not yet: a split over ranks and speculative decoding. The compiled kernels run the delta rule
(``kernels/csrc/delta_rule.cpp``) and a decode step's every layer in one call
(``backends/cpu/decode_program.py``)."""

from ..family import DENSE_LAYER_NAMES, VALUE_HEADS_TILED_KEY, Family

# the Gated DeltaNet layers' tensors, by the roles ``kinds.gated_deltanet`` gives them
DELTA_RULE_NAMES = {
    "linear_qkv": "linear_attn.in_proj_qkv",
    "linear_z": "linear_attn.in_proj_z",
    "linear_b": "linear_attn.in_proj_b",
    "linear_a": "linear_attn.in_proj_a",
    "linear_out": "linear_attn.out_proj",
    "linear_conv": "linear_attn.conv1d",
    "linear_norm": "linear_attn.norm",
    "linear_dt_bias": "linear_attn.dt_bias",
    "linear_A_log": "linear_attn.A_log",
}

# its tensors llama.cpp's converter changed: A_log written as -exp(A_log), the convolution [channels, taps]
GGUF_UNDO = {
    "linear_A_log": lambda a: (-a).log(),
    "linear_conv": lambda w: w.unsqueeze(1),
}


def gguf_config(get, tensor) -> dict:
    """The delta rule's sizes and which layers are attention, from a ``qwen35`` file's metadata."""
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0))
    recurrent = list(get("attention.recurrent_layers"))[:layers]
    key_heads, value_heads = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    return {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        VALUE_HEADS_TILED_KEY: key_heads != value_heads,
        "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim,
    }


FAMILY = Family(
    architecture="Qwen3_5ForCausalLM",
    model_type="qwen3_5_text",
    qk_norm="head",
    gguf_architecture="qwen35",
    gguf_config=gguf_config,
    gguf_roles={"post_attention_norm": "mlp_norm"},
    gguf_undo=GGUF_UNDO,
    layer_names={**DENSE_LAYER_NAMES, **DELTA_RULE_NAMES},
    norm_weight_offset=1.0,
    layer_type_mixers={"linear_attention": "gated_deltanet", "full_attention": "attention"},
    partial_rotary=True,
    attention_output_gate=True,
    skipped_prefixes=("mtp.",),
)
