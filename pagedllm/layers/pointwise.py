"""The pointwise ops in plain PyTorch, in HF transformers' order of operations and dtypes: the
reference the compiled kernels are tested against (``backends.cpu.torch_backend`` runs them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm in float32, then cast (so fp32 logits agree with transformers to rounding); the
    last multiply is done in place (same values, no copy)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype).mul_(weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim, in the activation dtype as HF."""
    inner = gate_up.shape[-1] // 2
    out = F.silu(gate_up[:, :inner])
    return out.mul_(gate_up[:, inner:])


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up = [gate | up] (Gemma's GeGLU), as silu_mul."""
    inner = gate_up.shape[-1] // 2
    out = F.gelu(gate_up[:, :inner], approximate="tanh")
    return out.mul_(gate_up[:, inner:])


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on q [T, H, D] and k [T, KVH, D] (views of one qkv row are fine):
    x = x * cos + rotate_half(x) * sin."""
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.empty_like(x)
        torch.neg(x[..., half:], out=rotated[..., :half])
        rotated[..., half:] = x[..., :half]
        x.mul_(cos[:, None, :]).add_(rotated.mul_(sin[:, None, :]))
