"""The step's building blocks below the model: attention over the paged KV cache, the cache
itself, the sampler, and the tensor layers the decoders share (norm, rotary, MLP).

Kernels go here, each behind the seam of the layer it replaces. Importing this package imports
no torch: ``workspace`` holds the kernels' size limits, which the memory planner reads.
"""
