"""Speculative decoding by n-gram prompt lookup: guessed tokens verified in the request's own step.

A decoding sequence whose last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``)
occurred earlier in its prompt or output proposes the tokens that followed that occurrence (the
latest one), up to ``num_speculative_tokens``. The scheduler appends them to the sequence's
one-token decode row, so the step computes K/V and logits for the last real token and every
guess; the runner then samples each position in order, exactly as decoding would one token at
a time (the same sampler, the same generator draws, the penalties seeing the tokens accepted
before), and keeps a guess only while it equals the token sampled at its place. The first
mismatch ends it: the token sampled there is the step's last, and the guesses after it are
bookkeeping: their K/V are past the computed count (overwritten when those positions are
computed) and a block taken only for them is given back. Greedy and seeded outputs are
therefore identical to decoding without speculation, and sampled ones follow the model's
distribution (a deterministic guess is accepted exactly when the model samples it).

Who guesses is a ``Proposer``: ``NgramProposer`` here, or ``engine.drafter.DraftModel`` (a
smaller model of the same tokenizer, its greedy tokens: a deterministic proposal too, so the
same verification is exact for it).

When it speculates (``Speculation.rows_allowed``): only while the step is small enough that
the guesses' logits rows stay within what the memory plan counts (``max_num_seqs`` rows), so
the extra rows never cost a batch that is already compute-bound. Under a grammar, guesses are cut
to what it accepts (``structured.allowed_prefix``) and each guessed position is masked as the
grammar stands after the guesses before it (``Grammars.mask_guessed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .sequence import Sequence


@dataclass(frozen=True)
class Speculation:
    """The engine's speculative settings (``EngineConfig.speculative_*``)."""

    num_tokens: int  # guesses per step, at most
    lookup_min: int
    lookup_max: int

    def rows_allowed(self, sequences: int, max_num_seqs: int) -> bool:
        """Whether a step of this many decoding sequences may carry guesses."""
        return sequences * (1 + self.num_tokens) <= max_num_seqs


class Proposer(Protocol):
    """Guesses for decoding sequences, asked once a step before the scheduler fills it."""

    # whether a request whose guesses keep missing should pause guessing: a draft model's passes
    # cost a step's worth each; an n-gram miss costs a row and a pause would lose bursts of hits
    pause_after_misses: bool

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to ``limits[i]`` guessed tokens to follow ``seqs[i]``'s last one, for each."""
        ...

    def forget(self, seq_id: int) -> None:
        """A sequence ended: whatever is kept for it can go."""
        ...


class NgramProposer:
    """Prompt lookup (``propose``): no state, no weights."""

    pause_after_misses = False

    def __init__(self, spec: Speculation):
        self.spec = spec

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [propose(seq.tokens(0, seq.num_tokens), self.spec, limit) for seq, limit in zip(seqs, limits)]

    def forget(self, seq_id: int) -> None:
        pass


def propose(tokens: list[int], spec: Speculation, limit: int) -> list[int]:
    """Up to ``min(spec.num_tokens, limit)`` tokens that followed the latest earlier occurrence
    of the longest suffix of ``tokens`` of ``lookup_max`` .. ``lookup_min`` tokens; [] if none.
    One pass from the end over the earlier positions holding the last token (~30 us at 1000
    tokens; slicing at every position cost ~350)."""
    k = min(spec.num_tokens, limit)
    n_tokens = len(tokens)
    if k <= 0 or n_tokens < 2:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    for end in range(n_tokens - 2, -1, -1):  # an earlier occurrence ends at `end`
        if tokens[end] != last:
            continue
        n = 1
        while n < spec.lookup_max and n <= end and tokens[end - n] == tokens[n_tokens - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_end = n, end
            if n == spec.lookup_max:
                break
    if best_len < spec.lookup_min:
        return []
    return tokens[best_end + 1 : best_end + 1 + k]
