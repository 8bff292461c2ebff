"""The two CPU backends side by side, to compare the compiled kernels with the PyTorch
arithmetic they replace (the ``ops`` fixture makes sure the kernels build first)."""

from pagedllm import backends


def torch_backend():
    return backends.get("cpu-torch")


def compiled_backend():
    return backends.get("cpu-compiled")
