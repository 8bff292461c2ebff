"""What the engine hands back for a request: text, tokens, why it ended, and when things happened."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    delta_text: str = ""  # text that became final since the previous output of this request
    error: str | None = None
    logprobs: list[dict] | None = None
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    extra: dict = field(default_factory=dict)
