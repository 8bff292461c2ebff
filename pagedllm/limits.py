"""RequestLimits: what an engine can ever run, fixed when it starts; checks a request against them.

A plain value, so the server's API process checks every request where it arrives (and answers
400 at once) even when the engine runs in another process: only a structured output's grammar,
which needs the engine's compiler, is checked there.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RequestRejected
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def cache_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raises RequestRejected, naming the field to blame, for a request that can never run."""
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        if params.n > self.max_num_seqs:
            raise RequestRejected(f"n={params.n} samples exceed max_num_seqs={self.max_num_seqs}", param="n")
        need = len(ids) + params.max_tokens
        capacity = self.cache_capacity_tokens
        limit = min(self.max_model_len, capacity)
        if need > limit:
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} tokens exceeds "
                f"max_model_len={self.max_model_len} (the KV cache holds {capacity} "
                f"tokens: {self.num_blocks} blocks of {self.block_size})",
                param="prompt" if len(ids) >= limit else "max_tokens",
                code="context_length_exceeded",
            )
