"""Running one call on the pure-PyTorch path, to compare the compiled kernels with it."""

from pagedllm.kernels import select


def on_torch_path(fn, *args):
    previous = select("torch")
    try:
        return fn(*args)
    finally:
        select(previous)
