"""Phi-3 and Phi-3.5: Llama with fused q/k/v and gate/up in the checkpoint, LongRoPE."""
