"""What the recurrent mixers share (``kinds/gated_deltanet``, ``kinds/mamba2``): a short causal
convolution over part of the projected input, continued from each sequence's state slot, then a
recurrence per sequence whose matrix state also lives in a slot.

The step's flat batch mixes sequences. Each reads and writes its own slot
(``attn.layout.state_slots``; ``attn.sequence_states(layer)`` holds every slot's ``conv`` and
``recurrent`` tensors). A sequence whose first computed token is its first (context length =
tokens this step) starts from zero state, whatever the slot's last owner left; the others continue
theirs, so a prompt cut into chunks gives the state one uninterrupted pass would. Decode rows (one
token, state continued, no checkpoint) are updated together (``RecurrentMixer.step``); a prompt's
chunk runs the recurrence in chunked form (``RecurrentMixer.chunk``), stopping at each of the
step's checkpoint positions (``attn.layout.checkpoints``) to copy both states out there.

Written once here so that the two kinds cannot differ in what is easiest to get wrong: which
state a sequence starts from, and at which token a checkpoint is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ..backends.base import Backend


class CausalConv(nn.Module):
    """A depthwise causal convolution's taps [channels, 1, taps] (and bias), under the
    checkpoint's ``conv1d.weight``/``conv1d.bias`` names."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    def window(self, window: torch.Tensor) -> torch.Tensor:
        """silu of the convolution over ``window`` [channels, taps - 1 + n]: [n, channels], float32."""
        bias = self.bias.float() if self.bias is not None else None
        return F.silu(F.conv1d(window[None], self.weight.float(), bias, groups=window.shape[0])[0].T)

    def last(self, windows: torch.Tensor) -> torch.Tensor:
        """silu of the convolution's last output of each of ``windows`` [n, channels, taps]: [n, channels]."""
        out = (windows * self.weight.float()[:, 0]).sum(-1)
        return F.silu(out + self.bias.float() if self.bias is not None else out)

    def step(self, backend: Backend, pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One new input each (x [n, channels]) of the sequences whose windows are ``pool[slots]``
        ([slots, channels, taps - 1], shifted in place): silu of each convolution's output, by the
        device's kernel where it has one, else gathered, summed and put back."""
        done = backend.conv_state_step(pool, slots, x, self.weight, self.bias, silu=True)
        if done is not None:
            return done
        windows = torch.cat([pool[slots], x.float()[:, :, None]], dim=2)  # [n, C, taps]
        pool[slots] = windows[:, :, 1:]
        return self.last(windows)


@dataclass
class StepRuns:
    """How a step's sequences run through a recurrent mixer, the same for every such layer of the
    step (derived once: ``StepLayout.derived``)."""

    starts: list[int]  # each sequence's first row, and the end
    ends: list[int]  # each one's context length after the step
    slots: list[int]  # its state slot
    copied: dict[int, list[tuple[int, int]]]  # sequence -> (tokens in, checkpoint slot)
    decodes: list[int]  # the sequences updated together: one token, state continued, no checkpoint
    rows: torch.Tensor  # the decodes' rows
    index: torch.Tensor  # their slots

    @classmethod
    def of(cls, layout) -> StepRuns:
        memo = getattr(layout, "derived", None)
        if memo is not None and "recurrent runs" in memo:
            return memo["recurrent runs"]
        starts, ends = layout.query_start.tolist(), layout.context_lens.tolist()
        slots = layout.state_slots.tolist()
        copied: dict[int, list[tuple[int, int]]] = {}
        for s, at, slot in layout.checkpoints.tolist():
            copied.setdefault(s, []).append((at, slot))
        decodes = [s for s in range(len(slots)) if starts[s + 1] - starts[s] == 1 and ends[s] > 1 and s not in copied]
        rows, index = torch.tensor([starts[s] for s in decodes]), torch.tensor([slots[s] for s in decodes])
        runs = cls(starts, ends, slots, copied, decodes, rows, index)
        if memo is not None:
            memo["recurrent runs"] = runs
        return runs


def all_decode(attn) -> StepRuns | None:
    """The step's runs where every sequence of it is a decode row (one token, state continued, no
    checkpoint: its rows are its sequences, in order), else None."""
    runs = StepRuns.of(attn.layout)
    return runs if len(runs.decodes) == len(runs.slots) else None


class NormScale(nn.Module):
    """A recurrent mixer's gated norm's scale, under the checkpoint's ``norm.weight``."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)


class RecurrentMixer(nn.Module):
    """A mixer whose ``conv1d`` (a ``CausalConv``) feeds a recurrence: a subclass says how a
    chunk of one sequence's tokens and a decode group's tokens update it, given the convolved
    channels and its per-token ``gates`` (tensors of the step's rows, indexed as ``rows``)."""

    layer: int
    conv1d: CausalConv
    backend: Backend

    def chunk(self, convolved: torch.Tensor, gates: tuple, rows: slice, state: torch.Tensor) -> torch.Tensor:
        """One sequence's consecutive tokens: its ``state`` (one slot's) updated in place; the
        outputs [n, heads, value_dim] float32."""
        raise NotImplementedError

    def step(
        self, convolved: torch.Tensor, gates: tuple, rows: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One token each of several sequences, their states ``pool[slots]`` updated; the outputs."""
        raise NotImplementedError

    def fused_step(
        self, mixed: torch.Tensor, gates: tuple, rows: torch.Tensor, states: dict, slots: torch.Tensor
    ) -> torch.Tensor | None:
        """The decode group's convolution and update in one call of the device's, where it has
        one (``mixed``: the group's rows of the convolution's input; both states in place in
        their slots); None: the steps here run."""
        return None

    def recur(self, mixed: torch.Tensor, gates: tuple, attn, out: torch.Tensor) -> None:
        """Every sequence of the step: ``mixed`` [T, channels] the convolution's input, ``out``
        [T, heads, value_dim] written row for row."""
        states, runs = attn.sequence_states(self.layer), StepRuns.of(attn.layout)
        starts, ends, slots, copied, decodes = runs.starts, runs.ends, runs.slots, runs.copied, runs.decodes
        if decodes:
            rows, index = runs.rows, runs.index
            fused = self.fused_step(mixed[rows], gates, rows, states, index)
            if fused is not None:
                out[rows] = fused
            else:
                convolved = self.conv1d.step(self.backend, states["conv"], index, mixed[rows])
                out[rows] = self.step(convolved, gates, rows, states["recurrent"], index)
        for s in sorted(set(range(len(slots))) - set(decodes)):
            lo, hi = starts[s], starts[s + 1]
            conv, recurrent = states["conv"][slots[s]], states["recurrent"][slots[s]]
            if ends[s] == hi - lo:  # its first tokens: a fresh state (a slot's last owner left its own)
                conv.zero_()
                recurrent.zero_()
            window = torch.cat([conv, mixed[lo:hi].float().T], dim=1)  # [channels, taps - 1 + n]
            convolved = self.conv1d.window(window)
            done = 0
            for at, slot in sorted(copied.get(s, [])) + [(hi - lo, -1)]:  # up to each checkpoint, copied out there
                run = slice(lo + done, lo + at)
                out[run] = self.chunk(convolved[done:at], gates, run, recurrent)
                if slot >= 0:
                    kept = attn.state_checkpoints(self.layer)
                    kept["conv"][slot] = window[:, at : at + conv.shape[1]]  # the inputs before position at
                    kept["recurrent"][slot] = recurrent
                done = at
            conv.copy_(window[:, window.shape[1] - conv.shape[1] :])
