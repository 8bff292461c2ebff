"""Qwen3.5/3.6 (text): Gated DeltaNet layers beside gated full attention."""
