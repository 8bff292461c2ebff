"""Sequence: one sample of a request, as the scheduler, block manager, runner and engine see it.

A request asking for ``n`` samples starts as one sequence (index 0) that carries the other n - 1
as ``pending_forks``. Its prompt is computed once; just before its last prompt token, it forks:
the children share every prompt block (the block manager counts references), and each one then
computes the last prompt token itself, into its own copy of the shared partial block
(copy-on-write), and samples its own first token. Until then a forking sequence occupies n of the
scheduler's ``max_num_seqs`` slots, so forking never exceeds the planned batch.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..outputs import ErrorKind
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..structured import Matcher

_seq_ids = itertools.count()


class Finish(NamedTuple):
    """Why a sequence ends: "stop" | "length" | "abort" | "error" (then with an error and its kind)."""

    reason: str
    error: str | None = None
    error_kind: ErrorKind | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n samples
    seq_id: int = field(default_factory=lambda: next(_seq_ids))  # the block manager's key
    pending_forks: int = 0  # samples still to split off this one (see the module docstring)
    group: list[Sequence] = field(default_factory=list)  # every sample of the request, forked or not
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # speculative guesses its next step may carry (None: the configured most): one more than its
    # last guessed step accepted, so a request whose guesses keep missing spends one row, not k
    guess_limit: int | None = None
    guess_misses: int = 0  # guessed steps in a row that accepted nothing
    guess_pause: int = 0  # steps to decode without guesses: 2^(misses - 1) - 1, at most 15
    # a draft model's distribution [guesses, vocab] at each guess it drew for this step (a sampled
    # request's); None: its guesses are deterministic (n-gram, or a draft's greedy tokens)
    guess_probs: torch.Tensor | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    matcher: Matcher | None = None  # the grammar's state, for a request with a structured_output
    # text state, kept by the engine's detokenizer
    text: str = ""
    emitted_chars: int = 0
    logprobs: list[dict] = field(default_factory=list)
    # with params.prompt_logprobs: one entry per prompt token computed so far (the first is None);
    # the samples a request forks into share the list, complete by then
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    # with params.pooling: the sum of its pooled hidden states so far, and over how many tokens
    pooled_sum: torch.Tensor | None = None
    pooled_count: int = 0
    embedding: list[float] | None = None  # once its prompt is computed
    # timings (time.perf_counter seconds)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
        if not self.group:
            self.group.append(self)
        if self.index == 0 and not self.pending_forks:
            self.pending_forks = self.params.n - 1
        if self.generator is None and self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed + self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def width(self) -> int:
        """Scheduler slots this sequence holds: itself plus the samples it will fork into."""
        return 1 + self.pending_forks

    @property
    def ready_to_fork(self) -> bool:
        return self.pending_forks > 0 and self.num_computed_tokens == self.num_prompt_tokens - 1

    def fork(self) -> list[Sequence]:
        """Splits off the pending samples: same prompt, computed state and timings, own seed."""
        children = [
            replace(
                self,
                index=len(self.group) + i,
                seq_id=next(_seq_ids),
                pending_forks=0,
                group=self.group,
                output_token_ids=[],
                generator=None,
                matcher=self.matcher.fork() if self.matcher is not None else None,
                logprobs=[],
                guess_probs=None,
            )
            for i in range(self.pending_forks)
        ]
        self.group.extend(children)
        self.pending_forks = 0
        return children

    def prompt_logits_wanted(self, start: int, end: int) -> int:
        """How many of positions [start, end) still owe a prompt logprob: position p's logits
        give token p + 1's, so the last prompt position owes none (it samples). They are the
        last of the range, as prompt logprobs are collected in order."""
        if self.params.prompt_logprobs is None:
            return 0
        first = max(start, len(self.prompt_logprobs) - 1, 0)
        return max(0, min(end, self.num_prompt_tokens - 1) - first)

    @property
    def prefix_cache_limit(self) -> int:
        """How many of its first tokens the prefix cache may skip: all, unless it still owes prompt
        logprobs (then only positions already collected: a cache hit computes no logits)."""
        if self.params.pooling == "mean":  # every prompt token's hidden state is pooled
            return 0
        if self.params.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens:
            return self.num_tokens
        return max(0, len(self.prompt_logprobs) - 1)

    def pooled_positions(self, start: int, end: int) -> int:
        """How many of the last of positions [start, end) an embedding request pools: all of
        them ("mean"), or the last prompt token ("last")."""
        if self.params.pooling == "mean":
            return end - start
        if self.params.pooling == "last":
            return int(end == self.num_prompt_tokens)
        return 0

    def pool(self, summed: torch.Tensor, count: int) -> None:
        """Adds ``count`` pooled hidden states (their sum); at the end of the prompt, the embedding."""
        self.pooled_sum = summed if self.pooled_sum is None else self.pooled_sum + summed
        self.pooled_count += count
        if self.num_computed_tokens == self.num_prompt_tokens:
            mean = self.pooled_sum / self.pooled_count
            self.embedding = torch.nn.functional.normalize(mean, dim=0).tolist()

    def tokens(self, start: int, end: int) -> list[int]:
        p = self.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        return (p + self.output_token_ids)[start:end]

    def append_token(self, token: int, logprob: dict | None) -> bool:
        """Appends a sampled token; False if the grammar refuses it (it was masked out, so only a
        bug lets one through)."""
        self.output_token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        return self.matcher is None or self.matcher.accept_token(token)

    def mark_finished(self, finish: Finish) -> None:
        self.status = Status.FINISHED
        self.pending_forks = 0  # a request aborted before it forked has no other samples
        self.finish_reason, self.error, self.error_kind = finish
        self.finish_time = time.perf_counter()

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def request_finished(self) -> bool:
        """Every sample of the request has finished (none is left to fork)."""
        return all(s.is_finished for s in self.group)
