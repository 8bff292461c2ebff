"""LFM2 (Liquid's, made for CPUs): most layers a gated short convolution (``kinds/short_conv``, a
few hidden-size rows of state per sequence), the others attention with q and k RMS-normed per
head; every feed-forward a SwiGLU MLP whose width the config derives (``block_auto_adjust_ff_dim``:
two thirds of ``intermediate_size``, times ``block_ffn_dim_multiplier``, up to a multiple of
``block_multiple_of``). Its checkpoint names its norms and the final norm its own way
(``module_names``).

llama.cpp writes its GGUF files as ``lfm2``: the attention layers told apart by their KV heads
(``attention.head_count_kv`` a list, 0 for a convolution layer), the MLP's width as computed,
the convolution's taps [channels, taps] (``shortconv.conv``; ``gguf_undo`` gives back the middle
axis), the state's length as ``shortconv.l_cache`` and the final norm as ``token_embd_norm``.

Not yet: LFM2-MoE, a split over ranks, speculative decoding, compiled kernels for the convolution."""

from ..family import DENSE_LAYER_NAMES, Family


def _normalised(d: dict) -> dict:
    """LFM2's config.json with the common fields under their usual names: its MLP's real width, its eps."""
    width = int(d["intermediate_size"])
    if d.get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        if d.get("block_ffn_dim_multiplier") is not None:
            multiple = int(d.get("block_multiple_of") or 1)
            width = int(float(d["block_ffn_dim_multiplier"]) * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return {**d, "intermediate_size": width, "rms_norm_eps": d.get("norm_eps", d.get("rms_norm_eps", 1e-5))}


def gguf_config(get, tensor) -> dict:
    """The layer types, the convolution and the MLP's width (already derived) from an ``lfm2`` file."""
    layers = int(get("block_count"))
    kv_heads = get("attention.head_count_kv")
    kv_heads = list(kv_heads) if isinstance(kv_heads, list) else [int(kv_heads)] * layers
    types = ["conv" if int(h) == 0 else "full_attention" for h in kv_heads]
    first_conv = types.index("conv") if "conv" in types else 0
    return {
        "layer_types": types,
        "conv_L_cache": int(get("shortconv.l_cache")),
        "conv_bias": tensor(f"blk.{first_conv}.shortconv.in_proj.bias") is not None,
        "block_auto_adjust_ff_dim": False,  # feed_forward_length is the width the blocks use
    }


FAMILY = Family(
    architecture="Lfm2ForCausalLM",
    model_type="lfm2",
    gguf_architecture="lfm2",
    gguf_config=gguf_config,
    gguf_final_norm="token_embd_norm",
    gguf_undo={"conv_taps": lambda w: w.unsqueeze(1)},
    qk_norm="head",
    layer_names={
        **DENSE_LAYER_NAMES,
        "o": "self_attn.out_proj",
        "gate": "feed_forward.w1",
        "up": "feed_forward.w3",
        "down": "feed_forward.w2",
        "conv_in": "conv.in_proj",
        "conv_out": "conv.out_proj",
        "conv_taps": "conv.conv",
    },
    layer_type_mixers={"conv": "short_conv", "full_attention": "attention"},
    normalise_config=_normalised,
    module_names={
        "input_layernorm": "operator_norm",
        "post_attention_layernorm": "ffn_norm",
        "q_norm": "q_layernorm",
        "k_norm": "k_layernorm",
        "norm": "embedding_norm",
    },
)
