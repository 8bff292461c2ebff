"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``): most layers Mamba-2 (``kinds/mamba2``, a fixed
state per sequence), the others attention, without positions where ``position_embedding_type``
is not "rope" (Granite-4.0-H's are "nope"); every feed-forward a mixture of experts, routed by a
softmax over the top-k logits, plus a shared expert added ungated; or, with no experts
(``num_local_experts`` 0: -H-Micro), the shared MLP alone. Granite's multipliers: the embeddings
times ``embedding_multiplier``, q.k by ``attention_multiplier``, each sub-layer's output times
``residual_multiplier`` before its add, the logits divided by ``logits_scaling``.

Its checkpoint fuses a layer's experts (``block_sparse_moe.input_linear`` [experts, 2 x width,
hidden], gate rows then up rows; ``output_linear`` [experts, hidden, width]) and the shared MLP's
gate and up (``shared_mlp.input_linear``); ``unfuse`` splits them into one tensor per role.

llama.cpp writes its GGUF files as ``granitehybrid``: the attention layers told apart by their KV
heads (``attention.head_count_kv`` a list, 0 for a Mamba-2 layer), positions as
``rope.scaling.finetuned``, the multipliers as ``embedding_scale``, ``attention.scale``,
``residual_scale`` and ``logit_scale``; a Mamba-2 layer's projections as ``ssm_in``/``ssm_out``, A_log
as ``ssm_a`` holding -exp(A_log) [heads, 1], D as ``ssm_d`` [heads, 1], the convolution's taps
[channels, taps], the gated norm's scale per group [groups, channels / groups] (``gguf_undo`` gives
each back); the experts stacked, the shared MLP as ``ffn_*_shexp`` (or ``ffn_*`` with no experts).

Not yet: a split over ranks, speculative decoding, compiled kernels for the scan."""

from __future__ import annotations

from ..family import DENSE_LAYER_NAMES, Experts, Family

_SHARED = "shared_mlp"
_EXPERTS = "block_sparse_moe"

NAMES = {
    **DENSE_LAYER_NAMES,
    "mamba_in": "mamba.in_proj",
    "mamba_out": "mamba.out_proj",
    # the shared MLP: the dense layer's roles, or a mixture's shared expert's
    "gate": f"{_SHARED}.gate",
    "up": f"{_SHARED}.up",
    "down": f"{_SHARED}.output_linear",
    "shared_expert_gate": f"{_SHARED}.gate",
    "shared_expert_up": f"{_SHARED}.up",
    "shared_expert_down": f"{_SHARED}.output_linear",
    "router": f"{_EXPERTS}.router.layer",
    # what llama.cpp's GGUF names apart from the layer's own parameters (read as they are from safetensors)
    "mamba_conv": "mamba.conv1d",
    "mamba_norm": "mamba.norm",
    "mamba_dt_bias": "mamba.dt_bias",
    "mamba_A_log": "mamba.A_log",
    "mamba_D": "mamba.D",
    "expert_gate": f"{_EXPERTS}.experts.{{e}}.gate",
    "expert_up": f"{_EXPERTS}.experts.{{e}}.up",
    "expert_down": f"{_EXPERTS}.experts.{{e}}.down",
}


def unfuse(name: str, tensor, cfg=None) -> list[tuple[str, object]] | None:
    """The shared MLP's gate and up, and each expert's gate, up and down, from the fused tensors
    (``name`` under ``model.layers.N.``); None for any other. Slices only (any array type)."""
    prefix, _, leaf = name.rpartition(".")
    layer, _, part = prefix.rpartition(".")
    if leaf != "weight" or not layer.endswith((_SHARED, _EXPERTS)) or part not in ("input_linear", "output_linear"):
        return None
    if layer.endswith(_SHARED):
        if part == "output_linear":
            return None  # the down projection as it is
        half = tensor.shape[0] // 2
        return [(f"{layer}.gate.weight", tensor[:half]), (f"{layer}.up.weight", tensor[half:])]
    out: list[tuple[str, object]] = []
    for e in range(tensor.shape[0]):
        each = f"{layer}.experts.{e}"
        if part == "input_linear":
            half = tensor.shape[1] // 2
            out += [(f"{each}.gate.weight", tensor[e][:half]), (f"{each}.up.weight", tensor[e][half:])]
        else:
            out.append((f"{each}.down.weight", tensor[e]))
    return out


def _normalised(d: dict) -> dict:
    """Granite's config.json with the common fields under their usual names: the shared expert's
    width (the dense MLP's where there are no experts) and the layers without positions."""
    shared = int(d["shared_intermediate_size"])
    dense = not int(d.get("num_local_experts") or 0)
    layers = int(d["num_hidden_layers"])
    return {
        **d,
        "shared_expert_intermediate_size": shared,
        "intermediate_size": shared if dense else d["intermediate_size"],
        "no_rope_layers": [int(d.get("position_embedding_type") == "rope")] * layers,
    }


def gguf_config(get, tensor) -> dict:
    """The layer types, the Mamba-2 sizes, the multipliers and the shared MLP's width from a
    ``granitehybrid`` file's metadata."""
    layers = int(get("block_count"))
    kv_heads = get("attention.head_count_kv")
    kv_heads = list(kv_heads) if isinstance(kv_heads, list) else [int(kv_heads)] * layers
    types = ["mamba" if int(h) == 0 else "attention" for h in kv_heads]
    first = types.index("mamba") if "mamba" in types else 0
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    return {
        "layer_types": types,
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_expand": inner // int(get("embedding_length")),
        "mamba_d_state": int(get("ssm.state_size")),
        "mamba_n_groups": int(get("ssm.group_count")),
        "mamba_d_conv": int(get("ssm.conv_kernel")),
        "mamba_conv_bias": tensor(f"blk.{first}.ssm_conv1d.bias") is not None,
        "mamba_proj_bias": tensor(f"blk.{first}.ssm_in.bias") is not None,
        "embedding_multiplier": float(get("embedding_scale", 1.0)),
        "attention_multiplier": float(get("attention.scale", 1.0)),
        "residual_multiplier": float(get("residual_scale", 1.0)),
        "logits_scaling": float(get("logit_scale", 1.0)),
        "position_embedding_type": "rope" if get("rope.scaling.finetuned", False) else "nope",
        "shared_intermediate_size": int(get("expert_shared_feed_forward_length")),
    }


FAMILY = Family(
    architecture="GraniteMoeHybridForCausalLM",
    model_type="granitemoehybrid",
    experts=Experts(
        every_layer=True,
        always_renormalise=False,
        count_key="num_local_experts",
        gguf_renormalised=True,  # (the top-k logits softmaxed: the renormalised softmax's weights)
        shared_expert=True,
        softmax_after_topk=True,
        shared_expert_gated=False,
        optional=True,
    ),
    layer_names=NAMES,
    unfuse=unfuse,
    gguf_architecture="granitehybrid",
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    gguf_roles={
        "ssm_in": "mamba_in",
        "ssm_out": "mamba_out",
        "ssm_conv1d": "mamba_conv",
        "ssm_norm": "mamba_norm",
        "ssm_dt": "mamba_dt_bias",
        "ssm_a": "mamba_A_log",
        "ssm_d": "mamba_D",
    },
    gguf_undo={
        "mamba_A_log": lambda a: (-a).log().flatten(),
        "mamba_D": lambda d: d.flatten(),
        "mamba_conv": lambda w: w.unsqueeze(1),
        "mamba_norm": lambda w: w.flatten(),
    },
    transformers_reads_gguf=False,
    # Granite's configs say "mamba"/"attention", transformers 5 writes "linear_attention"/"full_attention"
    layer_type_mixers={
        "mamba": "mamba2",
        "attention": "attention",
        "linear_attention": "mamba2",
        "full_attention": "attention",
    },
    normalise_config=_normalised,
)
