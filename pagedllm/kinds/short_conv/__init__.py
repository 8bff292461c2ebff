"""A gated short convolution (LFM2's ``conv`` layers): one projection gives B, C and x; B * x runs
through a depthwise causal convolution of a few taps (``conv_L_cache``), C gates its output, and
an output projection brings it back. What it keeps of a sequence: its convolution's last inputs
(``cache.py``), a few hidden-size rows, whatever the sequence's length."""
