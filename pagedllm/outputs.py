"""What the engine hands back for a request: text, tokens, why it ended, and when things happened."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Why a request ended in "error": refused when it was added ("rejected": the client's fault),
# the model's logits were not finite ("model"), its output could not be decoded ("detokenize"),
# or the engine itself failed ("engine").
ErrorKind = Literal["rejected", "model", "detokenize", "engine", "shutdown"]


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
class CompletionOutput:
    """One of the n samples of a request (``SamplingParams.n``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None


@dataclass
class RequestOutput:
    """The state of one sample of a request. The engine emits one per sample whenever it has new
    text or finishes (``index`` says which sample; ``request_finished`` that all are done).
    ``LLM.generate`` returns one per prompt: sample 0's fields, and every sample in ``outputs``."""

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
    index: int = 0
    request_finished: bool = False
    outputs: list[CompletionOutput] = field(default_factory=list)
    error_kind: ErrorKind | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (the first None), each
    # {"token": (id, logprob), "top": [(id, logprob), ...], "rank": the token's, 1 = most likely}
    prompt_logprobs: list[dict | None] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling: the pooled, normalised vector

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text, self.token_ids, self.finish_reason, self.logprobs, self.error, self.error_kind
        )

    @classmethod
    def failed(cls, request_id: str, prompt_token_ids: list[int], error: str, kind: ErrorKind) -> RequestOutput:
        """The one output of a request that ended in error before producing anything."""
        return cls(
            request_id, prompt_token_ids, "", [], True, "error", error=error, error_kind=kind, request_finished=True
        )
