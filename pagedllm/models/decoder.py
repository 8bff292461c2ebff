"""One decoder for Llama, SmolLM, Mistral, Qwen2 and Qwen3.

They differ only in switches that ``ModelConfig`` carries: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), sliding-window layers (Mistral), tied embeddings, rope scaling. Module names
match HF checkpoints so weights load by name.

``forward`` takes one flat batch of tokens from many sequences (no padding), their positions,
the attention seam for this step, and the rows whose logits are wanted: logits are computed for
those rows only, never for every prompt token.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.mlp import MLP
from ..layers.norm import RMSNorm
from ..layers.rotary import Rotary, apply_rotary_


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.sliding_windows[layer] if cfg.sliding_windows else None
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.q_norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, attn):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        apply_rotary_(q, cos, sin)
        apply_rotary_(k, cos, sin)
        out = attn.attend(self.layer, q, k, v, self.scale, self.window)
        del q, k, v
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, attn):
        # Residual adds in place: h is this step's own buffer (same values as h + x).
        h.add_(self.self_attn(self.input_layernorm(h), cos, sin, attn))
        return h.add_(self.mlp(self.post_attention_layernorm(h)))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Built empty (the checkpoint fills it): nn.Embedding's own init would draw normal_
        # samples, and on the meta device that imports ~70 MB of torch's decompositions.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, positions: [T]; logits_rows: [S] rows of the batch to sample from.

        Returns float32 logits [S, vocab].
        """
        body = self.model
        h = body.embed_tokens(input_ids)
        cos, sin = body.rotary.tables(positions, h.dtype)
        for layer in body.layers:
            h = layer(h, cos, sin, attn)
        h = body.norm(h.index_select(0, logits_rows))
        return self.lm_head(h).float()
