"""Mamba-2's scan, the arithmetic of its layer's memory (PyTorch, float32).

Each head keeps a state ``S`` (state_size x head_dim) that a token updates as

    S <- exp(g) S + k v^T          (g = dt A <= 0; k = B, the token's group's; v = dt x)
    o  = S^T q                     (q = C)

a linear attention with a scalar decay per head and token. A decode step is that update once per
sequence (``recurrent_step``). A prompt runs in chunks of ``CHUNK`` tokens (``chunked``): with
Γ_i the decay from the chunk's start to token i (exp of the running sum of g) and S0 the state
before it,

    O = Γ Q S0 + (M ∘ Q K^T) V,    M_ij = Γ_i/Γ_j for j <= i, else 0,
    S_C = Γ_C S0 + K^T ((Γ_C/Γ) V),

where every ratio is exp of a sum of g's <= 0 and cannot overflow. The gated delta rule
(``kinds/gated_deltanet/delta_rule.py``) is this plus a correction toward v; transformers' Mamba-2
reference sums the same terms in another order (its ``mamba2_chunk_scan``); the tests compare.
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk: a chunk's matrices are CHUNK x CHUNK per head


def recurrent_step(q, k, v, g, state: torch.Tensor) -> torch.Tensor:
    """One token per sequence: q, k [n, heads, state_size], v [n, heads, head_dim], g [n, heads];
    ``state`` [n, heads, state_size, head_dim] updated in place. Returns o [n, heads, head_dim]."""
    state.mul_(g.exp()[..., None, None]).add_(k[..., :, None] * v[..., None, :])
    return torch.einsum("nhkv,nhk->nhv", state, q)


def chunked(q, k, v, g, state: torch.Tensor) -> torch.Tensor:
    """One sequence's tokens: q, k [t, heads, state_size], v [t, heads, head_dim], g [t, heads];
    ``state`` [heads, state_size, head_dim] updated in place. Returns o [t, heads, head_dim]."""
    out = torch.empty_like(v)
    for first in range(0, q.shape[0], CHUNK):
        end = min(first + CHUNK, q.shape[0])
        qc, kc, vc = (x[first:end].transpose(0, 1) for x in (q, k, v))
        out[first:end] = _chunk(qc, kc, vc, g[first:end].T, state).transpose(0, 1)
    return out


def _chunk(q, k, v, g, state: torch.Tensor) -> torch.Tensor:
    """One chunk, heads first: q, k [h, c, n], v [h, c, p], g [h, c]; state [h, n, p]."""
    c = q.shape[1]
    decay = g.cumsum(-1)  # log Γ_i
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    ratio = (decay[:, :, None] - decay[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # Γ_i/Γ_j, j <= i
    out = decay.exp()[..., None] * (q @ state) + (ratio * (q @ k.transpose(1, 2))) @ v
    last = decay[:, -1:]  # log Γ_C
    state.mul_(last.exp()[..., None]).add_(k.transpose(1, 2) @ ((last - decay).exp()[..., None] * v))
    return out
