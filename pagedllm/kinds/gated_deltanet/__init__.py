"""Gated DeltaNet (Qwen3.5/3.6's ``linear_attention`` layers): a linear attention whose memory of
a sequence is a fixed state, not its tokens' K/V. q, k and v come from one projection through a
short causal convolution; each value head's state (key_dim x value_dim) is updated by the gated
delta rule (``delta_rule.py``) and read by q; the output is RMS-normed, gated by silu(z) and
projected back. The state per sequence: the convolution's last inputs and the rule's matrices, in
float32 (``cache.py``)."""
