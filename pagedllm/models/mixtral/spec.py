"""Mixtral: Mistral's attention, every layer sparse (``num_local_experts``, the chosen experts'
probabilities always renormalised), its experts named ``w1``/``w3``/``w2`` under
``block_sparse_moe``. llama.cpp writes it as ``llama`` with experts."""

from ..family import DENSE_LAYER_NAMES, Experts, Family

FAMILY = Family(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    gguf_architecture="llama",
    sliding="every layer",
    experts=Experts(every_layer=True, always_renormalise=True, count_key="num_local_experts", gguf_renormalised=True),
    layer_names={
        **DENSE_LAYER_NAMES,
        "router": "block_sparse_moe.gate",
        "expert_gate": "block_sparse_moe.experts.{e}.w1",
        "expert_up": "block_sparse_moe.experts.{e}.w3",
        "expert_down": "block_sparse_moe.experts.{e}.w2",
    },
    gguf_permuted_qk=True,
)
