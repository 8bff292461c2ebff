"""Llama (and SmolLM): the plain decoder every other family varies."""
