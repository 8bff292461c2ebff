"""gpt-oss (gpt-oss-20b, -120b): Llama-like attention with biases and a learned sink logit per
head, sliding (128 tokens) and full layers alternating (``layer_types``), YaRN rope; every layer
sparse, the router biased and its top-k logits softmaxed among themselves, each expert a biased
SwiGLU clamped to ``swiglu_limit`` (``layers/mlp.py``).

Its checkpoints fuse a layer's experts in four tensors: ``mlp.experts.gate_up_proj`` [experts,
hidden, 2 x width] with gate and up in alternate columns, its bias [experts, 2 x width],
``down_proj`` [experts, width, hidden] and its bias. ``unfuse`` turns each into one tensor per
expert under the names the roles give (each [out, in], as a ``Linear`` holds it), so they load
like any family's. OpenAI's own checkpoints store the experts in MXFP4 (``_blocks``/``_scales``),
which the loader refuses by name.
"""

from __future__ import annotations

from ...errors import UnsupportedModelError
from ..family import DENSE_LAYER_NAMES, Experts, Family

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


FAMILY = Family(
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
    gguf_architecture=None,  # its GGUF files ("gpt-oss") are not read yet: refused as an unknown architecture
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
)
