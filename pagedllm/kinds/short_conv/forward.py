"""A gated short convolution as a module: B, C, x from one GEMM, the depthwise causal convolution
of B * x continued from each sequence's state slot (``attn.sequence_states``; a sequence whose
first token is in the step starts from zeros), C times its output, the output projection. Its
state is copied out at the step's checkpoint positions (``attn.layout.checkpoints``), as the
delta rule's is. A step's decode rows (one token, state continued, no checkpoint) are convolved
together, in the device's kernel where it has one (``Backend.conv_state_step``: each window in
place in its slot); a prompt's tokens in PyTorch, a sequence at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...layers.linear import Linear
from ...layers.recurrence import StepRuns

if TYPE_CHECKING:
    from ...backends.base import Backend

# the checkpoint's name of the part under ``model.layers.N.``
CHECKPOINT_NAME = "conv"


def build(cfg: ModelConfig, layer: int, backend: Backend) -> ShortConv:
    return ShortConv(cfg, layer, backend)


class _Conv(nn.Module):
    """The depthwise convolution's taps (and bias) under the checkpoint's ``conv.conv`` names."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: Backend):
        super().__init__()
        conv = cfg.short_conv
        assert conv is not None
        self.layer, self.backend, h = layer, backend, cfg.hidden_size
        self.in_proj = Linear(h, [3 * h], bias=conv.bias, backend=backend)  # B, C, x: one tensor in the checkpoint
        self.out_proj = Linear(h, [h], bias=conv.bias, backend=backend)
        self.conv = _Conv(h, conv.kernel, conv.bias)

    def checkpoint_roles(self) -> dict[Linear, tuple[str, ...]]:
        """Its linear layers -> the roles of their parts (``family.Family.name_of``)."""
        return {self.in_proj: ("conv_in",), self.out_proj: ("conv_out",)}

    def forward(self, x: torch.Tensor, ropes, attn) -> torch.Tensor:
        """``ropes`` unused (no positions: the convolution is the order); ``attn``: the step's seam."""
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        gated = (b * v).float()
        states, layout = attn.sequence_states(self.layer)["conv"], attn.layout
        starts, ends = layout.query_start.tolist(), layout.context_lens.tolist()
        kept = [(s, at, slot) for s, at, slot in layout.checkpoints.tolist()]
        weight = self.conv.weight.float()
        bias = self.conv.bias.float() if self.conv.bias is not None else None
        out = torch.empty_like(gated)
        runs, together = StepRuns.of(layout), set()
        if runs.decodes:
            done = self.backend.conv_state_step(states, runs.index, gated[runs.rows], weight, bias, silu=False)
            if done is not None:
                out[runs.rows], together = done, set(runs.decodes)
        for s, slot in enumerate(layout.state_slots.tolist()):
            if s in together:
                continue
            lo, hi = starts[s], starts[s + 1]
            state = states[slot]
            if ends[s] == hi - lo:  # its first tokens: a fresh state
                state.zero_()
            window = torch.cat([state, gated[lo:hi].T], dim=1)  # [hidden, kernel - 1 + n]
            out[lo:hi] = F.conv1d(window[None], weight, bias, groups=window.shape[0])[0].T
            for _, at, checkpoint in (k for k in kept if k[0] == s):  # the inputs before position at
                attn.state_checkpoints(self.layer)["conv"][checkpoint] = window[:, at : at + state.shape[1]]
            state.copy_(window[:, window.shape[1] - state.shape[1] :])
        return self.out_proj((c.float() * out).to(x.dtype))
