"""Qwen2 (and Qwen2.5): q, k and v biased, o not, whatever ``attention_bias`` says; sliding
windows from ``max_window_layers`` on when ``use_sliding_window``."""

from ..family import Family

FAMILY = Family(architecture="Qwen2ForCausalLM", model_type="qwen2", gguf_architecture="qwen2", qkv_bias="always")
