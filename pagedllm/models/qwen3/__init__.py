"""Qwen3: q and k RMS-normed per head."""
