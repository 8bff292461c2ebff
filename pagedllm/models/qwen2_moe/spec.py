"""Qwen2-MoE: Qwen2's attention; sparse layers every ``decoder_sparse_step`` but
``mlp_only_layers``, each with a dense shared expert gated by a sigmoid."""

from ..family import DENSE_LAYER_NAMES, EXPERT_NAMES, Experts, Family

FAMILY = Family(
    architecture="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    gguf_architecture="qwen2moe",
    qkv_bias="always",
    experts=Experts(
        every_layer=False,
        always_renormalise=False,
        count_key="num_experts",
        gguf_renormalised=False,
        shared_expert=True,
    ),
    layer_names={**DENSE_LAYER_NAMES, **EXPERT_NAMES},
)
