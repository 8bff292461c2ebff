"""Qwen3.5/3.6 MoE (text, Qwen3.5-35B-A3B's kind): Qwen3.5's mixers (``models/qwen3_5``: Gated
DeltaNet and gated full attention) with every feed-forward a mixture of experts
(``moe_intermediate_size`` wide, the top-k renormalised) and a dense shared expert gated by a
sigmoid, as Qwen2-MoE's. llama.cpp writes it as ``qwen35moe``, laid out as Qwen3.5's ``qwen35``
with stacked experts. The same not-yet as Qwen3.5's."""

from dataclasses import replace

from ..family import EXPERT_NAMES, Experts
from ..qwen3_5.spec import FAMILY as QWEN3_5

FAMILY = replace(
    QWEN3_5,
    architecture="Qwen3_5MoeForCausalLM",
    model_type="qwen3_5_moe_text",
    gguf_architecture="qwen35moe",
    experts=Experts(
        every_layer=False,
        always_renormalise=True,
        count_key="num_experts",
        gguf_renormalised=True,
        shared_expert=True,
    ),
    layer_names={**QWEN3_5.layer_names, **EXPERT_NAMES},
)
