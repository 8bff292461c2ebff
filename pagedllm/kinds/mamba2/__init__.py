"""Mamba-2 (Granite-4.0-H's ``mamba`` layers): a selective state space whose memory of a sequence is
a fixed state, not its tokens' K/V. x, B and C come from one projection through a short causal
convolution; each head's state (state_size x head_dim) decays by exp(dt A) and takes B (dt x)^T
each token, and C reads it (``scan.py``: a linear attention with a scalar decay per head). The
output, plus D x, is gated by silu(z), RMS-normed per group and projected back. The state per
sequence: the convolution's last inputs and the heads' matrices, float32 (``cache.py``)."""
