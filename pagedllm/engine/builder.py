"""build_engine: an EngineConfig to a running LLMEngine, planned before any weight is loaded.

The one way an engine comes to be, in this process (``LLM``) or in its own (``engine_process``):
what the process holds is measured first (tokenizer, kernels, grammar compiler included), the plan
is checked against the budget from config.json alone, then the weights load and the cache is made.
"""

from __future__ import annotations

from .. import backends, loading, structured
from ..config import ModelConfig
from ..engine_config import ConfigError, EngineConfig
from ..memory.machine import (
    bound_allocator_slack,
    bound_kernel_caches,
    release_library_pages,
    resident_bytes,
    return_freed_heap,
)
from .llm_engine import LLMEngine, plan_for, stop_token_ids


def build_engine(config: EngineConfig, api_process_bytes: int = 0) -> LLMEngine:
    """``api_process_bytes``: what the server's API process holds at its peak when the engine runs
    in a process of its own; the budget covers both processes, so it is counted in the baseline.
    Raises CacheDoesNotFitError (before loading) when the plan cannot fit."""
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            "tensor_parallel_size",
            f"{config.tensor_parallel_size}: the engine runs on one process only (tensor parallelism is not "
            "implemented yet); `pagedllm plan --tensor-parallel-size N` sizes each rank of a split model",
        )
    model_dir, name = loading.resolve_model_dir(config.model)  # a GGUF file is converted in a child process
    tokenizer = loading.load_tokenizer(model_dir)  # before measuring: it belongs to the baseline
    model_config = ModelConfig.from_file(model_dir)
    backend = backends.get(config.backend)  # kernels built or loaded before measuring
    grammars = None
    with_grammars = config.structured_output and tokenizer is not None and structured.available()
    if with_grammars and config.budgeted:  # before measuring too; else at the first constrained request
        eos = stop_token_ids(model_config, tokenizer)
        grammars = structured.Grammars(tokenizer, model_config.vocab_size, eos)
        return_freed_heap()  # building it parsed the vocabulary and the tokenizer's JSON: temporaries
    if config.budgeted:
        bound_allocator_slack()
        bound_kernel_caches()
        release_library_pages()
    weights_bytes, quantized = loading.checkpoint_weights(model_dir, config.dtype, config.quantization)
    plan = plan_for(
        config,
        model_config,
        name,
        backend,
        with_grammars=tokenizer is not None,
        weights_bytes=weights_bytes,
        quantized_weights=quantized,
        baseline_bytes=resident_bytes()[0],
        api_process_bytes=api_process_bytes,
    )
    loaded = loading.load_dir(
        model_dir, name, config.dtype, tokenizer=tokenizer, quantization=config.quantization, backend=backend
    )
    return LLMEngine(loaded, config, plan=plan, grammars=grammars)
