"""Qwen3.5/3.6 MoE (text): Qwen3.5's layers with a mixture of experts and a shared expert."""
