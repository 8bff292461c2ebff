"""LFM2: gated short convolutions beside attention layers."""
