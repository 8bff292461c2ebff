"""Qwen3-Next: Qwen3.5-MoE's layers, its delta-rule projections fused per key head in the checkpoint."""
