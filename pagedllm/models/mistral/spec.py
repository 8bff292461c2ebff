"""Mistral: Llama with ``sliding_window`` on every layer; llama.cpp writes its GGUF files as
``llama`` (read back as Llama: the window is not in them)."""

from ..family import Family

FAMILY = Family(architecture="MistralForCausalLM", model_type="mistral", sliding="every layer")
