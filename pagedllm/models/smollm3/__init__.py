"""SmolLM3: Llama with every fourth layer's rotary positions left out (NoPE)."""
