"""The gated delta rule, the arithmetic of a Gated DeltaNet layer's memory (PyTorch, float32).

Each value head keeps a state ``S`` (key_dim x value_dim) that a token updates as

    S <- exp(g) * S                        (decay: g <= 0, the token's forget gate)
    u  = beta * (v - S^T k)                (what S predicts for k is corrected toward v)
    S <- S + k u^T
    o  = S^T q

with q and k L2-normalised and q scaled by key_dim^-1/2. A decode step is that update once per
sequence (``recurrent_step``). A prompt runs in chunks of ``CHUNK`` tokens (``chunked``): within a
chunk, with Γ_i the decay from the chunk's start to token i (exp of the running sum of g) and S0 the
state before it, every update unrolls to

    S_i = Γ_i S0 + Σ_{j<=i} (Γ_i/Γ_j) k_j u_j^T,
    u_i = β_i (v_i - Γ_i S0^T k_i - Σ_{j<i} (Γ_i/Γ_j)(k_i·k_j) u_j),

so U solves one unit lower-triangular system (I + A) U = β (V - Γ K S0) with
A_ij = β_i (Γ_i/Γ_j)(k_i·k_j) for j < i, and the chunk's outputs and last state are matrix
products: O = Γ Q S0 + (M ∘ Q K^T) U with M_ij = Γ_i/Γ_j for j <= i, S_C = Γ_C S0 + K^T (Γ_C/Γ) U.
Every ratio Γ_i/Γ_j with j <= i is exp of a sum of g's <= 0: none overflows. Transformers'
reference does the same sums in another order (its ``torch_chunk_gated_delta_rule``); the tests
compare the two.
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per triangular solve: a chunk's matrices are CHUNK x CHUNK per head


def normalised(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [..., key_dim] L2-normalised (eps 1e-6 under the root, as the reference), q scaled."""
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token per sequence: q, k [n, heads, key_dim] (normalised), v [n, heads, value_dim],
    g, beta [n, heads]; ``state`` [n, heads, key_dim, value_dim] updated in place. Returns o
    [n, heads, value_dim]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("nhkv,nhk->nhv", state, k)
    u = (v - predicted) * beta[..., None]
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("nhkv,nhk->nhv", state, q)


def chunked(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence's tokens: q, k [t, heads, key_dim] (normalised), v [t, heads, value_dim],
    g, beta [t, heads]; ``state`` [heads, key_dim, value_dim] updated in place. Returns o
    [t, heads, value_dim]."""
    out = torch.empty_like(v)
    for first in range(0, q.shape[0], CHUNK):
        end = min(first + CHUNK, q.shape[0])
        qc, kc, vc = (x[first:end].transpose(0, 1) for x in (q, k, v))
        out[first:end] = _chunk(qc, kc, vc, g[first:end].T, beta[first:end].T, state).transpose(0, 1)
    return out


def _chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One chunk, heads first: q, k [h, c, dk], v [h, c, dv], g, beta [h, c]; state [h, dk, dv]."""
    c = q.shape[1]
    decay = g.cumsum(-1)  # log Γ_i
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    ratio = (decay[:, :, None] - decay[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # Γ_i/Γ_j, j <= i
    gamma = decay.exp()[..., None]
    a = (beta[..., None] * ratio * (k @ k.transpose(1, 2))).tril(-1)
    rhs = beta[..., None] * (v - gamma * (k @ state))
    eye = torch.eye(c, dtype=q.dtype)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    out = gamma * (q @ state) + (ratio * (q @ k.transpose(1, 2))) @ u
    last = decay[:, -1:]  # log Γ_C
    state.mul_(last.exp()[..., None]).add_(k.transpose(1, 2) @ ((last - decay).exp()[..., None] * u))
    return out
