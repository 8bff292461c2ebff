"""OLMoE: every layer sparse (64 experts, ``intermediate_size`` wide), q and k RMS-normed over
the whole projection, q/k/v clamped to ``clip_qkv`` when set."""

from ..family import DENSE_LAYER_NAMES, EXPERT_NAMES, Experts, Family

FAMILY = Family(
    architecture="OlmoeForCausalLM",
    model_type="olmoe",
    gguf_architecture="olmoe",
    qk_norm="all",
    experts=Experts(every_layer=True, always_renormalise=False, count_key="num_experts", gguf_renormalised=False),
    layer_names={**DENSE_LAYER_NAMES, **EXPERT_NAMES},
    transformers_reads_gguf=False,
)
