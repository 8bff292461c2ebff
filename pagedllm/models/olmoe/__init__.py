"""OLMoE: every layer sparse, q and k normed over the whole projection."""
