"""The tensor layers the decoders are stacked from, device-independent: linear (stacked,
prepacked) and quantized (int8/int4 and GGUF's blocks kept as stored; superblocks, codebooks),
norm, rotary, pointwise (the reference arithmetic), and the sampler.
Beside them, what keeps part of a model in its file: the expert cache and the layer stream, and
their stored reads. Attention over the paged cache and the cache itself are the device's
(``backends/<device>/``); the layer kinds' modules (attention, the MLP, the mixture of experts) are each in its kind's
folder (``pagedllm/kinds/``).
"""
