"""Attention as a layer part: what the layer projects, norms and rotates, and the output
projection; the attention over the paged cache itself is the device's (``backend``'s ``attend``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear
from ...layers.norm import RMSNorm

if TYPE_CHECKING:
    from ...backends.base import Backend


# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "self_attn"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> Attention:
    return Attention(cfg, layer, backend)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: Backend):
        super().__init__()
        self.layer = layer
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.rope = cfg.rope_of_layer(layer)  # which of the step's rotary tables; None: no positions
        self.window = cfg.sliding_windows[layer] if cfg.sliding_windows else None
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        # Qwen3.5: each head's q rows are followed by as many rows of its output gate
        self.gated = cfg.attention_output_gate
        q_rows = 2 * self.q_size if self.gated else self.q_size
        self.rotary_dim = cfg.rotary_dim  # the first dims of each head that rotate (Qwen3.5: a quarter)
        self.qkv_proj = Linear(h, [q_rows, self.kv_size, self.kv_size], bias=cfg.qkv_bias, backend=backend)
        self.o_proj = Linear(self.q_size, [h], bias=cfg.o_bias, backend=backend)
        # per head (Qwen3), or over the whole projection (OLMoE)
        q_width, k_width = (self.q_size, self.kv_size) if cfg.qk_norm_scope == "all" else (d, d)
        self.q_norm: RMSNorm | None = RMSNorm(q_width, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(k_width, cfg.rms_norm_eps, backend) if cfg.qk_norm else None
        self.norm_whole, self.clip = cfg.qk_norm_scope == "all", cfg.qkv_clip
        # gpt-oss: a logit per head that joins every softmax's denominator (float32 when attending)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``)."""
        return {self.qkv_proj: ("q", "k", "v"), self.o_proj: ("o",)}

    def forward(self, x, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], attn):
        """``ropes``: the step's rotary tables (cos, sin) by kind (``ModelConfig.rope_of_layer``)."""
        t, dk = x.shape[0], self.kv_size
        dq = 2 * self.q_size if self.gated else self.q_size
        qkv = self.qkv_proj(x)
        gate = None
        if self.gated:  # [q of head 0, gate of head 0, q of head 1, ...]
            q_and_gate = qkv[:, :dq].view(t, self.num_heads, 2, self.head_dim)
            q, gate = q_and_gate[:, :, 0].contiguous(), q_and_gate[:, :, 1].reshape(t, self.q_size)
        else:
            q = qkv[:, :dq].view(t, self.num_heads, self.head_dim)
        k = qkv[:, dq : dq + dk].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, dq + dk :].view(t, self.num_kv_heads, self.head_dim)
        dq = self.q_size
        if self.q_norm is not None and self.k_norm is not None:
            if self.norm_whole:
                q = self.q_norm(q.reshape(t, dq)).view(t, self.num_heads, self.head_dim)
                k = self.k_norm(k.reshape(t, dk)).view(t, self.num_kv_heads, self.head_dim)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        if self.rope is not None and self.rotary_dim < self.head_dim:  # rotate the first dims only
            q_part, k_part = q[..., : self.rotary_dim].contiguous(), k[..., : self.rotary_dim].contiguous()
            self.backend.rotary_(q_part, k_part, *ropes[self.rope])
            q[..., : self.rotary_dim], k[..., : self.rotary_dim] = q_part, k_part  # (this step's own tensors)
        elif self.rope is not None:
            self.backend.rotary_(q, k, *ropes[self.rope])
        sinks = self.sinks.float() if self.sinks is not None else None
        out = attn.attend(self.layer, q, k, v, self.scale, self.window, sinks)
        del q, k, v, qkv
        if gate is not None:
            out = out.view(t, dq) * torch.sigmoid(gate)
        return self.o_proj(out.view(t, dq))
