"""SamplingParams: how one request's tokens are chosen and when it stops. Checked on creation,
so a bad value fails at submission with a message naming it, never inside a step.

The sampling fields a model may set defaults for (``MODEL_DEFAULT_FIELDS``) are None until the
request reaches an engine, which fills the unset ones (``with_defaults``) by one rule: what the
caller set; else the model's own defaults (its ``generation_config.json``, or the sampling
metadata of its GGUF file); else ``INTERACTIVE_DEFAULTS``, chosen by measurement to keep small chat
models out of repetition loops (docs/sampling.md). ``temperature=0`` is greedy.

``structured_output`` constrains what may be generated (docs/structured-output.md): a JSON schema,
any JSON object, a regular expression, a choice among strings, or an EBNF grammar.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MODEL_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# Measured on 20 everyday questions x 5 seeds with the default model (docs/sampling.md).
INTERACTIVE_DEFAULTS: dict[str, float] = {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
# A field neither the caller, the model nor INTERACTIVE_DEFAULTS sets is off.
SAMPLING_OFF: dict[str, float] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint on the output; the engine compiles it once per distinct value.

    ``json``: a JSON schema (dict or its text); ``json_object``: any JSON object; ``regex``: the
    whole output matches it; ``choice``: the output is one of these strings; ``grammar``: an
    EBNF grammar in xgrammar's (GBNF-compatible) syntax, starting at ``root``."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # the request field to blame when it does not compile (the server sets e.g. "response_format")
    param: str = "structured_output"

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutput: give exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutput: choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutput: json must be a JSON schema (a dict or its text)")

    @property
    def kind(self) -> str:
        """What the constraint is, as an error message names it."""
        if self.json is not None:
            return "JSON schema"
        if self.json_object:
            return "JSON object"
        return "regex" if self.regex is not None else "choice" if self.choice is not None else "grammar"

    def key(self) -> tuple:
        """Equal for constraints that compile to the same grammar (the cache's key)."""
        text = self.json if isinstance(self.json, str) or self.json is None else _canonical_json(self.json)
        return (text, self.json_object, self.regex, self.choice, self.grammar)


def _canonical_json(value: Any) -> str:
    import json

    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"StructuredOutput: the JSON schema is not JSON: {e}") from None


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # None: the model's default (module docstring); 0 = greedy
    temperature: float | None = None
    top_k: int | None = None  # 0 or -1 = off
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; n = chosen token plus the top n
    # the prompt's own tokens' logprobs (the model's raw distribution at each position; the first
    # token has none) with the top n at each: None = off. Computed in the prompt's own pass
    prompt_logprobs: int | None = None
    # an embedding request: the prompt's last hidden states pooled ("last" token or "mean"),
    # L2-normalised, in RequestOutput.embedding; nothing is generated
    pooling: str | None = None
    n: int = 1  # samples of this prompt; they share its KV blocks. With a seed, sample i uses seed + i.
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        unset = lambda v: v is None  # noqa: E731  (a field left to the model's default)
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (unset(self.temperature) or self.temperature >= 0, "temperature must be >= 0"),
            (
                unset(self.top_k) or isinstance(self.top_k, int) and self.top_k >= 0,
                "top_k must be an integer >= 0 (or -1 for off)",
            ),
            (unset(self.top_p) or 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (unset(self.min_p) or 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (unset(self.repetition_penalty) or self.repetition_penalty > 0, "repetition_penalty must be > 0"),
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
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                "prompt_logprobs must be None or an integer in [0, 20]",
            ),
            (self.pooling in (None, "last", "mean"), "pooling must be None, 'last' or 'mean'"),
            (self.pooling is None or self.n == 1, "an embedding request (pooling) takes n=1"),
            (
                self.seed is None or isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63,
                "seed must be None or an integer in [-2**63, 2**63)",
            ),
            (isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1"),
            (
                self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                "structured_output must be a StructuredOutput",
            ),
            (
                self.structured_output is None or not (self.ignore_eos or self.min_tokens),
                "ignore_eos and min_tokens cannot be combined with structured_output: the grammar decides "
                "where the output ends",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_defaults(self, model_defaults: Mapping[str, float]) -> SamplingParams:
        """A copy with every unset sampling field filled: the model's default, else
        ``INTERACTIVE_DEFAULTS`` (applied as a whole only when the model sets none), else off.
        Greedy stays plain greedy: with ``temperature=0`` given, unset fields are off (a default
        repetition penalty would change which token is the most likely)."""
        base = dict(model_defaults) if model_defaults else dict(INTERACTIVE_DEFAULTS)
        if self.temperature == 0:
            base = {}
        fills: dict[str, Any] = {
            f: base.get(f, SAMPLING_OFF[f]) for f in MODEL_DEFAULT_FIELDS if getattr(self, f) is None
        }
        return replace(self, **fills) if fills else self
