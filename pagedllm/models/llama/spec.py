"""Llama: the plain decoder (SmolLM2 is one). llama.cpp's converter permutes its q/k rows."""

from ..family import Family

FAMILY = Family(architecture="LlamaForCausalLM", model_type="llama", gguf_architecture="llama", gguf_permuted_qk=True)
