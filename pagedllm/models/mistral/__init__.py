"""Mistral: Llama with one sliding window on every layer."""
