"""Granite-4.0-H: Mamba-2 layers beside attention layers, mixtures with an ungated shared expert."""
