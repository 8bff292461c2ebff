"""Gemma 3 (text; Gemma3ForCausalLM, 270M to 27B): five sliding-window layers (512-4096 tokens)
to one full layer (``layer_types``), the sliding ones with a rope base of their own (10k against
the full layers' 1M); q and k RMS-normed per head; scores scaled by ``query_pre_attn_scalar``;
the embeddings times sqrt(hidden); the MLP's gate through GELU (tanh); each sub-layer's input and
output normed (``sandwich_norms``), every norm multiplying by (1 + weight).

llama.cpp writes its GGUF files as ``gemma3`` with each norm's weight already plus one (its
converter adds it); ``gguf_convert`` takes it off again, so a converted checkpoint reads as
transformers' does."""

from ..family import DENSE_LAYER_NAMES, Family

# What llama.cpp assumes of every gemma3 GGUF (its files do not say): one full layer in six, the
# sliding layers' rope base, and the scores' scale (1/sqrt(head_dim), but hidden/heads for the 27B)
SLIDING_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_HIDDEN = 5376


def gguf_config(get, tensor) -> dict:
    layers, hidden = int(get("block_count")), int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    config = {
        "layer_types": [
            "full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention" for i in range(layers)
        ],
        "sliding_window": int(get("attention.sliding_window")),
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": hidden // heads if hidden == GEMMA3_27B_HIDDEN else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if get("rope.scaling.type", "none") == "linear":  # 4B and up: the full layers' positions slowed 8x
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return config


FAMILY = Family(
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    gguf_architecture="gemma3",
    qk_norm="head",
    norm_weight_offset=1.0,
    embedding_scaled=True,
    sandwich_norms=True,
    gguf_config=gguf_config,
    gguf_rope_scalings=("linear",),
    layer_names={
        **DENSE_LAYER_NAMES,
        "attn_out_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
    },
)
