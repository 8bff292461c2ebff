"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention; sparse layers every ``decoder_sparse_step`` but
``mlp_only_layers``, ``moe_intermediate_size`` wide."""

from ..family import DENSE_LAYER_NAMES, EXPERT_NAMES, Experts, Family

FAMILY = Family(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    gguf_architecture="qwen3moe",
    qk_norm="head",
    experts=Experts(every_layer=False, always_renormalise=False, count_key="num_experts", gguf_renormalised=True),
    layer_names={**DENSE_LAYER_NAMES, **EXPERT_NAMES},
)
