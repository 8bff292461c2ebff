"""What the server needs of a model and of its engine, whichever way the engine runs.

``create_app`` takes a ``ServedModel``: an ``LLM`` (the engine steps on a thread of the server's
process, ``engine_process.engine_thread``) or an ``EngineProcess`` (a process of its own,
``engine_process.client``; what ``pagedllm serve`` runs). Its ``async_engine`` is the ``Engine``
the routes queue requests on. Protocols, so this package imports neither (nor torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..memory.planner import MemoryPlan
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, StructuredOutput


class Engine(Protocol):
    error: BaseException | None
    on_failure: list[Callable[[BaseException], None]]
    observers: list[Callable[[list[RequestOutput], float], None]]

    @property
    def stats(self) -> Any: ...  # EngineStats' fields
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_unfinished(self) -> int: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def validate(self, prompt: list[int], params: SamplingParams) -> None: ...
    async def compile(self, constraint: StructuredOutput) -> None: ...
    def add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: Any) -> Any: ...
    def abort(self, request_id: str) -> None: ...
    def abort_all(self) -> None: ...


class ServedModel(Protocol):
    tokenizer: Any
    memory_plan: MemoryPlan

    @property
    def name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]: ...
    def chat_template_source(self, tools: list[dict] | None = None) -> str: ...
    def async_engine(self, max_waiting: int) -> Engine: ...
