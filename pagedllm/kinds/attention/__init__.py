"""Attention over the paged K/V cache, full or over a sliding window: q/k/v from one stacked GEMM,
q and k normed (Qwen3, OLMoE) and rotated, attention (the device's), the output projection."""
