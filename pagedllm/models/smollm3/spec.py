"""SmolLM3 (SmolLM3ForCausalLM): Llama whose layers named 0 in ``no_rope_layers`` (every fourth
by default) attend without rotary positions; ``ModelConfig.rope_layers`` carries the list.

llama.cpp writes its GGUF files as ``smollm3``, q/k rows permuted as for Llama, and assumes every
fourth layer without positions (its files do not say): ``gguf_config`` says so again."""

from ..family import Family

NO_ROPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step for smollm3


def gguf_config(get, tensor) -> dict:
    layers = int(get("block_count"))
    return {"no_rope_layers": [0 if (i + 1) % NO_ROPE_EVERY == 0 else 1 for i in range(layers)]}


FAMILY = Family(
    architecture="SmolLM3ForCausalLM",
    model_type="smollm3",
    gguf_architecture="smollm3",
    gguf_permuted_qk=True,
    gguf_config=gguf_config,
    transformers_reads_gguf=False,
)
