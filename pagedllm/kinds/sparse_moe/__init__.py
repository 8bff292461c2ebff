"""A mixture of experts: a float32 router picks each token's experts, each a SwiGLU MLP (the
``dense_mlp`` kind's module), and sums their outputs by the router's weights; a shared expert
beside them where the family has one."""
