"""Gemma 3 (text): sliding and full layers, GeGLU, norms around both sub-layers."""
