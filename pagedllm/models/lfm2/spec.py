"""LFM2 (Liquid's, made for CPUs): most layers a gated short convolution (``kinds/short_conv``, a
few hidden-size rows of state per sequence), the others attention with q and k RMS-normed per
head; every feed-forward a SwiGLU MLP whose width the config derives (``block_auto_adjust_ff_dim``:
two thirds of ``intermediate_size``, times ``block_ffn_dim_multiplier``, up to a multiple of
``block_multiple_of``). Its checkpoint names its norms and the final norm its own way
(``module_names``). Not yet: GGUF files (``lfm2``), LFM2-MoE, a split over ranks, speculative
decoding, compiled kernels for the convolution."""

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


FAMILY = Family(
    architecture="Lfm2ForCausalLM",
    model_type="lfm2",
    qk_norm="head",
    layer_names={
        **DENSE_LAYER_NAMES,
        "o": "self_attn.out_proj",
        "gate": "feed_forward.w1",
        "up": "feed_forward.w3",
        "down": "feed_forward.w2",
        "conv_in": "conv.in_proj",
        "conv_out": "conv.out_proj",
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
