"""What crosses between the server's API process and the engine's process, in order.

Plain picklable values over one socket pair (``multiprocessing.connection``: length-prefixed
pickles). A step crosses as one ``Report``: for each sample that moved, only what is new since
the last report (``Delta``), so a message's size follows the step, not the length of the
outputs so far; the API process rebuilds each sample's whole output (``client.Outputs``).
Nothing here imports torch, nor may anything a message carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..engine_config import EngineConfig
from ..limits import RequestLimits
from ..memory.planner import MemoryPlan
from ..outputs import ErrorKind, RequestMetrics
from ..sampling_params import SamplingParams, StructuredOutput

# ---- API process -> engine process -----------------------------------------------------------


@dataclass
class Start:
    """The first message: the engine to build (answered by ``Resolved``)."""

    config: EngineConfig


@dataclass
class Build:
    """The second message of the start: build the engine, counting the API process's bytes."""

    api_process_bytes: int


@dataclass
class Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float  # time.perf_counter() in the API process (CLOCK_MONOTONIC: the same clock here)


@dataclass
class Abort:
    request_id: str


@dataclass
class AbortAll:
    """Shutdown: end everything added so far with an error saying so."""


@dataclass
class Compile:
    """Does this constraint's grammar compile? Answered by ``Compiled`` with the same ticket."""

    ticket: int
    constraint: StructuredOutput


@dataclass
class SetMemory:
    """A new budget for the engine (``LLMEngine.set_memory``). Answered by ``MemorySet``."""

    ticket: int
    memory: str | int | None
    memory_fraction: float | None = None


@dataclass
class Shutdown:
    """Stop stepping, answer what is left, exit 0."""


# ---- engine process -> API process -----------------------------------------------------------


@dataclass
class Resolved:
    """The first answer of the start: where the checkpoint is (the API process loads its tokenizer
    from it, then measures itself and sends ``Build``)."""

    model_dir: Path
    name: str


@dataclass
class Ready:
    plan: MemoryPlan
    limits: RequestLimits
    stats: dict


@dataclass
class StartFailed:
    """The engine could not be built; ``kind`` names the error (CacheDoesNotFitError, ...)."""

    kind: str
    message: str
    breakdown: dict | None = None
    suggestions: dict | None = None


@dataclass
class Delta:
    """What one sample gained since its previous delta."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None
    error: str | None
    error_kind: ErrorKind | None
    metrics: RequestMetrics | None
    request_finished: bool
    prompt_logprobs: list[dict | None] | None = None  # sent once, with a sample's first delta
    embedding: list[float] | None = None


@dataclass
class Report:
    """One batch of outputs (a step's, an abort's, a failure's), with the engine's counters after it.
    ``elapsed``: the step's seconds (None when no step ran); ``adds_taken``: how many ``Add``s the
    engine has taken so far (the API process counts the rest as still queued)."""

    deltas: list[Delta]
    stats: dict
    elapsed: float | None
    adds_taken: int


@dataclass
class Compiled:
    ticket: int
    rejection: tuple[str, str | None, str | None] | None  # RequestRejected's (message, param, code)


@dataclass
class MemorySet:
    ticket: int
    plan: MemoryPlan | None  # None when refused
    error: str | None  # why it was refused (the planner's message): nothing changed


@dataclass
class Died:
    """The engine thread failed (a bug): every request has had its error; the process exits 1."""

    error: str
