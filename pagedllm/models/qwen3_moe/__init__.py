"""Qwen3-MoE: Qwen3's attention, routed experts (Qwen3-30B-A3B)."""
