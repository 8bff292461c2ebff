"""gpt-oss: attention sinks, alternating 128-token windows, a biased top-k router, clamped SwiGLU experts."""
