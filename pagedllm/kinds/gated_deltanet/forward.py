"""A Gated DeltaNet layer as a module: one stacked projection (q/k/v, z, b, a: one GEMM), the
causal convolution over q/k/v continued from each sequence's state, the gated delta rule
(``delta_rule``) on each sequence's state, the gated RMS norm and the output projection.

The step's flat batch mixes sequences: each reads and writes its own state slot
(``attn.layout.state_slots``; ``attn.sequence_states(layer)`` holds every slot's tensors). A
sequence whose first computed token is its first (context length = tokens this step) starts from
zero state; the others continue theirs, so a prompt cut into chunks gives the state one
uninterrupted pass would. Decode rows (one token, state continued) are updated together; a
prompt's chunk runs the rule in chunked form (PyTorch). A decode row's update runs in the backend's
kernel where it has one (``Backend.delta_rule_decode``: the state in place in its slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear
from . import delta_rule

if TYPE_CHECKING:
    from ...backends.base import Backend

# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "linear_attn"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> GatedDeltaNet:
    return GatedDeltaNet(cfg, layer, backend)


class _Weight(nn.Module):
    """A parameter under a module name of the checkpoint's (``conv1d.weight``, ``norm.weight``)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)


class GatedDeltaNet(nn.Module):
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
        self.conv1d = _Weight(rule.conv_channels, 1, rule.conv_kernel)
        self.norm = _Weight(rule.value_head_dim)  # the gated norm's scale (no offset: not a zero-centred norm)
        self.dt_bias = nn.Parameter(torch.empty(rule.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(rule.value_heads), requires_grad=False)

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``)."""
        return {self.in_proj: ("linear_qkv", "linear_z", "linear_b", "linear_a"), self.out_proj: ("linear_out",)}

    def forward(self, x: torch.Tensor, ropes, attn) -> torch.Tensor:
        """``ropes`` unused (no positions: the state is the order); ``attn``: the step's seam."""
        mixed, z, b, a = self.in_proj(x).split(self.widths, dim=-1)
        beta = b.float().sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # g <= 0
        states, layout = attn.sequence_states(self.layer), attn.layout
        starts, ends = layout.query_start.tolist(), layout.context_lens.tolist()
        slots = layout.state_slots.tolist()
        copied: dict[int, list[tuple[int, int]]] = {}  # sequence -> (tokens in, checkpoint slot)
        for s, at, slot in layout.checkpoints.tolist():
            copied.setdefault(s, []).append((at, slot))
        out = torch.empty(x.shape[0], self.value_heads, self.value_dim, dtype=torch.float32)
        decodes = [s for s in range(len(slots)) if starts[s + 1] - starts[s] == 1 and ends[s] > 1 and s not in copied]
        if decodes:
            self._decode(decodes, starts, slots, mixed, decay, beta, states, out)
        for s in sorted(set(range(len(slots))) - set(decodes)):
            lo, hi = starts[s], starts[s + 1]
            conv, recurrent = states["conv"][slots[s]], states["recurrent"][slots[s]]
            if ends[s] == hi - lo:  # its first tokens: a fresh state (a slot's last owner left its own)
                conv.zero_()
                recurrent.zero_()
            stops = sorted(copied.get(s, [])) + [(hi - lo, -1)]
            window = torch.cat([conv, mixed[lo:hi].float().T], dim=1)  # [channels, kernel - 1 + n]
            q, k, v = self._heads(
                F.silu(F.conv1d(window[None], self.conv1d.weight.float(), groups=window.shape[0])[0].T)
            )
            done = 0
            for at, slot in stops:  # the rule up to each checkpoint, the state copied out there
                rows = slice(lo + done, lo + at)
                out[rows] = delta_rule.chunked(q[done:at], k[done:at], v[done:at], decay[rows], beta[rows], recurrent)
                if slot >= 0:
                    kept = attn.state_checkpoints(self.layer)
                    kept["conv"][slot] = window[:, at : at + conv.shape[1]]  # the inputs before position at
                    kept["recurrent"][slot] = recurrent
                done = at
            conv.copy_(window[:, window.shape[1] - conv.shape[1] :])
        return self.out_proj(self._gated_norm(out, z).to(x.dtype).view(x.shape[0], -1))

    def _decode(self, decodes, starts, slots, mixed, decay, beta, states, out) -> None:
        """One token each of several sequences: the delta rule's states updated in place in their
        slots by the backend's kernel, or gathered, updated and put back."""
        rows = torch.tensor([starts[s] for s in decodes])
        index = torch.tensor([slots[s] for s in decodes])
        window = torch.cat([states["conv"][index], mixed[rows].float()[:, :, None]], dim=2)  # [n, channels, kernel]
        states["conv"][index] = window[:, :, 1:]
        q, k, v = self._heads(F.silu((window * self.conv1d.weight.float()[:, 0]).sum(-1)))
        done = self.backend.delta_rule_decode(states["recurrent"], index, q, k, v, decay[rows], beta[rows])
        if done is not None:
            out[rows] = done
            return
        recurrent = states["recurrent"][index]
        out[rows] = delta_rule.recurrent_step(q, k, v, decay[rows], beta[rows], recurrent)
        states["recurrent"][index] = recurrent

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
