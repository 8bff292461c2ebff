"""Qwen2: q/k/v biased."""
