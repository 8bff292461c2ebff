"""Qwen3: q and k RMS-normed per head before rotary."""

from ..family import Family

FAMILY = Family(architecture="Qwen3ForCausalLM", model_type="qwen3", gguf_architecture="qwen3", qk_norm="head")
