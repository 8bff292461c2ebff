"""A Gated DeltaNet layer as a module: one stacked projection (q/k/v, z, b, a: one GEMM), the
causal convolution over q/k/v continued from each sequence's state, the gated delta rule
(``delta_rule``) on each sequence's state, the gated RMS norm and the output projection.

Which state each sequence of the step starts from, and where checkpoints are copied out, is
``layers.recurrence.RecurrentMixer``'s (shared with Mamba-2). A prompt's chunk runs in the
backend's kernel where it has one (``Backend.delta_rule_prefill``: token after token, the state
in place), else in chunked form (``delta_rule.chunked``, PyTorch); a decode row's update likewise
(``Backend.delta_rule_decode``: the state in place in its slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear
from ...layers.recurrence import CausalConv, NormScale, RecurrentMixer, all_decode
from . import delta_rule

if TYPE_CHECKING:
    from ...backends.base import Backend

# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "linear_attn"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> GatedDeltaNet:
    return GatedDeltaNet(cfg, layer, backend)


class GatedDeltaNet(RecurrentMixer):
    def __init__(self, cfg: ModelConfig, layer: int, backend: Backend):
        super().__init__()
        rule = cfg.delta_rule
        assert rule is not None
        self.layer, self.eps, self.backend = layer, cfg.rms_norm_eps, backend
        self.key_heads, self.value_heads = rule.key_heads, rule.value_heads
        self.key_dim, self.value_dim = rule.key_head_dim, rule.value_head_dim
        self.value_heads_tiled = rule.value_heads_tiled
        self.kernel = rule.conv_kernel
        keys, values = rule.key_heads * rule.key_head_dim, rule.value_heads * rule.value_head_dim
        self.widths = [rule.conv_channels, values, rule.value_heads, rule.value_heads]  # q/k/v, z, b, a
        self.qkv_widths = [keys, keys, values]
        self.in_proj = Linear(cfg.hidden_size, self.widths, bias=False, backend=backend)
        self.out_proj = Linear(values, [cfg.hidden_size], bias=False, backend=backend)
        self.conv1d = CausalConv(rule.conv_channels, rule.conv_kernel, bias=False)
        self.norm = NormScale(rule.value_head_dim)  # the gated norm's scale (no offset: not a zero-centred norm)
        self.dt_bias = nn.Parameter(torch.empty(rule.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(rule.value_heads), requires_grad=False)

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``)."""
        return {self.in_proj: ("linear_qkv", "linear_z", "linear_b", "linear_a"), self.out_proj: ("linear_out",)}

    def forward(self, x: torch.Tensor, ropes, attn) -> torch.Tensor:
        """``ropes`` unused (no positions: the state is the order); ``attn``: the step's seam."""
        mixed, z, b, a = self.in_proj(x).split(self.widths, dim=-1)
        runs = all_decode(attn)
        if runs is not None:  # a decode step: the layer between its projections in one call where the device can
            states = attn.sequence_states(self.layer)
            done = self.backend.gated_deltanet_layer_decode(self, mixed, z, b, a, states, runs.index)
            if done is not None:
                return self.out_proj(done.to(x.dtype))
        beta = b.float().sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # g <= 0
        out = torch.empty(x.shape[0], self.value_heads, self.value_dim, dtype=torch.float32)
        self.recur(mixed, (decay, beta), attn, out)
        return self.out_proj(self._gated_norm(out, z).to(x.dtype).view(x.shape[0], -1))

    def chunk(self, convolved, gates, rows, state) -> torch.Tensor:
        decay, beta = gates
        q, k, v = self._heads(convolved)
        done = self.backend.delta_rule_prefill(state, q, k, v, decay[rows], beta[rows])
        return done if done is not None else delta_rule.chunked(q, k, v, decay[rows], beta[rows], state)

    def fused_step(self, mixed, gates, rows, states, slots) -> torch.Tensor | None:
        decay, beta = (g[rows] for g in gates)
        pools, weight = (states["conv"], states["recurrent"]), self.conv1d.weight
        return self.backend.gated_deltanet_decode(
            *pools, slots, mixed, weight, decay, beta, self.key_heads, self.value_heads_tiled
        )

    def step(self, convolved, gates, rows, pool, slots) -> torch.Tensor:
        """The states updated in place in their slots by the backend's kernel, or gathered,
        updated and put back."""
        decay, beta = (g[rows] for g in gates)
        q, k, v = self._heads(convolved)
        done = self.backend.delta_rule_decode(pool, slots, q, k, v, decay, beta)
        if done is not None:
            return done
        recurrent = pool[slots]
        out = delta_rule.recurrent_step(q, k, v, decay, beta, recurrent)
        pool[slots] = recurrent
        return out

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved channels [n, channels] as q and k per value head (each key head serves
        value_heads / key_heads of them: the next ones, or every key_heads-th where the value
        heads are tiled), normalised, and v per value head."""
        n = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_widths, dim=-1)
        repeat = self.value_heads // self.key_heads
        if self.value_heads_tiled:
            q, k = (y.view(n, self.key_heads, self.key_dim).repeat(1, repeat, 1) for y in (q, k))
        else:
            q, k = (y.view(n, self.key_heads, self.key_dim).repeat_interleave(repeat, dim=1) for y in (q, k))
        q, k = delta_rule.normalised(q, k)
        return q, k, v.reshape(n, self.value_heads, self.value_dim)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each head's output RMS-normed, scaled, times silu(z) (float32 until the cast)."""
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight.float()
        return normed * F.silu(z.float().view_as(out))
