"""gpt-oss (gpt-oss-20b, -120b): Llama-like attention with biases and a learned sink logit per
head, sliding (128 tokens) and full layers alternating (``layer_types``), YaRN rope; every layer
sparse, the router biased and its top-k logits softmaxed among themselves, each expert a biased
SwiGLU clamped to ``swiglu_limit`` (``kinds/dense_mlp/forward.py``).

Its checkpoints fuse a layer's experts in four tensors: ``mlp.experts.gate_up_proj`` [experts,
hidden, 2 x width] with gate and up in alternate columns, its bias [experts, 2 x width],
``down_proj`` [experts, width, hidden] and its bias. ``unfuse`` turns each into one tensor per
expert under the names the roles give (each [out, in], as a ``Linear`` holds it), so they load
like any family's. OpenAI's own checkpoints store the experts in MXFP4 (``_blocks``/``_scales``),
which the loader refuses by name.

llama.cpp writes its GGUF files as ``gpt-oss``: the experts stacked per projection as for every
mixture (gate and up already apart, each with a bias tensor [experts, rows]), the sinks as
``attn_sinks``, the MLP's input norm as ``post_attention_norm``, and in its metadata the window
and the YaRN rope; the alternation (sliding first), the clamp (7) and the activation's alpha
(1.702) it hard-codes. Its experts are MXFP4 as OpenAI stored them (or what ``--outtype`` made of
float ones).
"""

from __future__ import annotations

from ...errors import UnsupportedModelError
from ..family import DENSE_LAYER_NAMES, Experts, Family

# What llama.cpp assumes of every gpt-oss GGUF and its metadata does not say (its
# ``llama_model_openai_moe``: a swa pattern of 2, ``LLM_FFN_SWIGLU_OAI_MOE``'s constants)
SLIDING_PATTERN = 2
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702

_EXPERTS = "mlp.experts"


def unfuse(name: str, tensor, cfg=None) -> list[tuple[str, object]] | None:
    """The per-expert tensors of a fused one (``name`` under ``model.layers.N.``), or None for a
    tensor that is not fused. Slices only: works on any array type, torch's included."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(_EXPERTS):
        return None
    if leaf.endswith(("_blocks", "_scales")):
        raise UnsupportedModelError(
            f"{name}: gpt-oss experts stored in MXFP4 safetensors are not read yet; give pagedllm a "
            "checkpoint with float experts (transformers dequantizes them when it loads and saves one)"
        )
    out: list[tuple[str, object]] = []
    for e in range(tensor.shape[0]):
        each = f"{prefix}.{e}"
        if leaf == "gate_up_proj":
            out += [
                (f"{each}.gate_proj.weight", tensor[e][:, 0::2].T),
                (f"{each}.up_proj.weight", tensor[e][:, 1::2].T),
            ]
        elif leaf == "gate_up_proj_bias":
            out += [(f"{each}.gate_proj.bias", tensor[e][0::2]), (f"{each}.up_proj.bias", tensor[e][1::2])]
        elif leaf == "down_proj":
            out.append((f"{each}.down_proj.weight", tensor[e].T))
        elif leaf == "down_proj_bias":
            out.append((f"{each}.down_proj.bias", tensor[e]))
        else:
            return None
    return out


def gguf_config(get, tensor) -> dict:
    """The config fields of a gpt-oss GGUF beyond the common ones. YaRN's dimension bounds are
    not rounded (``truncate``: False), as every gpt-oss config.json says; llama.cpp rounds them
    (ggml's ``ggml_rope_yarn_corr_dims``), which moves a few of the 32 frequencies slightly."""
    layers = int(get("block_count"))
    config: dict = {
        "layer_types": ["sliding_attention" if i % SLIDING_PATTERN == 0 else "full_attention" for i in range(layers)],
        "sliding_window": int(get("attention.sliding_window")),
        "intermediate_size": int(get("expert_feed_forward_length", get("feed_forward_length"))),
        "attention_bias": True,
        "swiglu_limit": SWIGLU_LIMIT,
        "swiglu_alpha": SWIGLU_ALPHA,
    }
    if get("rope.scaling.type", "none") == "yarn":
        config["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    return config


def fused_rank_part(name: str, shape: tuple[int, ...], range_of) -> tuple[int, int, int] | None:
    """A rank's one run of a fused expert tensor: its columns of every expert's width, which
    gate/up interleave (columns 2j and 2j + 1 are gate's and up's column j: the run is [2 x start,
    2 x stop)) and down holds as rows. The down bias is read whole (rank 0 adds it)."""
    leaf = name.rpartition(".")[2]
    width = range_of("expert")
    if leaf == "gate_up_proj":  # [experts, hidden, 2 x width]
        return len(shape) - 1, 2 * width.start, 2 * width.stop
    if leaf == "gate_up_proj_bias":  # [experts, 2 x width]
        return 1, 2 * width.start, 2 * width.stop
    if leaf == "down_proj":  # [experts, width, hidden]
        return 1, width.start, width.stop
    return None


FAMILY = Family(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    gguf_architecture="gpt-oss",
    experts=Experts(
        every_layer=True,
        always_renormalise=False,
        count_key="num_local_experts",
        gguf_renormalised=False,
        biased=True,
        softmax_after_topk=True,
        clamped_swiglu=True,
    ),
    layer_names={
        **DENSE_LAYER_NAMES,
        "router": "mlp.router",
        "expert_gate": _EXPERTS + ".{e}.gate_proj",
        "expert_up": _EXPERTS + ".{e}.up_proj",
        "expert_down": _EXPERTS + ".{e}.down_proj",
        "sinks": "self_attn.sinks",
    },
    attention_sinks=True,
    unfuse=unfuse,
    fused_rank_part=fused_rank_part,
    transformers_reads_gguf=False,
    gguf_config=gguf_config,
    gguf_rope_scalings=("yarn",),
    gguf_roles={"post_attention_norm": "mlp_norm"},
)
