"""Mixtral: Mistral's attention with eight experts a layer."""
