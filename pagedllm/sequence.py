"""Sequence: one request as the scheduler, block manager, runner and engine all see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    admitted_at: int = -1  # admission counter; the newest running sequence is preempted first
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # text state, kept by the engine's detokenizer
    text: str = ""
    emitted_chars: int = 0
    logprobs: list[dict] = field(default_factory=list)
    # timings (time.perf_counter seconds)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = self.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        return (p + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
