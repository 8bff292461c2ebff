"""SamplingParams: how one request's tokens are chosen and when it stops. Checked on creation,
so a bad value fails at submission with a message naming it, never inside a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n = chosen token plus the top n
    n: int = 1  # samples of this prompt; they share its KV blocks. With a seed, sample i uses seed + i.

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0 (or -1 for off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "min_tokens must be an integer in [0, max_tokens]",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ints >= 0"),
            (
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "logprobs must be None or an integer in [0, 20]",
            ),
            (
                self.seed is None or isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63,
                "seed must be None or an integer in [-2**63, 2**63)",
            ),
            (isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
