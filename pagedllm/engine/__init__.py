"""The engine: requests in, outputs out, one step at a time.

``LLMEngine.step`` is three calls: ``Scheduler.schedule`` picks the step's tokens under the
budget (``BlockManager`` gives them KV blocks), ``ModelRunner.run`` computes and samples them,
``Scheduler.update_from_output`` commits the result. ``Sequence`` is the one request state they
all share; ``Detokenizer`` turns tokens into released text.
"""

from .llm_engine import EngineStats, LLMEngine

__all__ = ["EngineStats", "LLMEngine"]
