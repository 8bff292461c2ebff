"""A dense SwiGLU (or GeGLU) MLP: gate and up from one stacked GEMM, their product, down."""
