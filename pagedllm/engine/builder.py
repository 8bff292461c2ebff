"""build_engine: an EngineConfig to a running LLMEngine, planned before any weight is loaded.

The one way an engine comes to be, in this process (``LLM``) or in its own (``engine_process``):
what the process holds is measured first (tokenizer, kernels, grammar compiler included), the plan
is checked against the budget from config.json alone, then the weights load and the cache is made.
"""

from __future__ import annotations

from .. import backends, loading, structured
from ..backends.base import Backend
from ..distributed.shards import RankShard, shard_layout
from ..engine_config import EngineConfig
from ..errors import ModelLoadError
from ..memory.machine import (
    bound_allocator_slack,
    bound_kernel_caches,
    release_library_pages,
    resident_bytes,
    return_freed_heap,
)
from ..memory.planner import plan_engine
from ..processes.driver_ranks import RankSetup, launched_rank
from . import rank_worker, ranks
from .drafter import draft_facts
from .llm_engine import LLMEngine
from .parts import assemble, grammars_possible, stop_token_ids


def build_engine(config: EngineConfig, api_process_bytes: int = 0) -> LLMEngine:
    """``api_process_bytes``: what the server's API process holds at its peak when the engine runs
    in a process of its own; the budget covers both processes, so it is counted in the baseline.
    Raises CacheDoesNotFitError (before loading) when the plan cannot fit.

    With ``tensor_parallel_size`` > 1 this process is the driver (rank 0): it starts or joins
    the other ranks first (``ranks.start``). On a launched rank other than 0 (torchrun) the call
    serves the driver headless until it closes the group, then ends the process (SystemExit 0)."""
    backend = backends.get(config.backend)  # kernels built or loaded before measuring
    model_dir, name = loading.resolve_model_dir(config.model)  # a GGUF file is converted in a child process
    ckpt = loading.Checkpoint.read(model_dir)  # config.json and the headers, once for the whole build
    if config.tensor_parallel_size == 1:
        return _build(config, api_process_bytes, backend, None, ckpt, name)
    shard_layout(ckpt.config, config.tensor_parallel_size)  # one that does not split: now
    launched = launched_rank()
    if launched is not None and launched.rank != 0:
        rank_worker.serve_launched(launched, config.backend)
        raise SystemExit(0)
    group = ranks.start(config, backend)
    try:
        return _build(config, api_process_bytes, backend, group, ckpt, name)
    except BaseException:
        group.close()
        raise


def _build(
    config: EngineConfig,
    api_process_bytes: int,
    backend: Backend,
    group: ranks.Ranks | None,
    ckpt: loading.Checkpoint,
    name: str,
) -> LLMEngine:
    tokenizer = loading.load_tokenizer(ckpt.model_dir)  # before measuring: it belongs to the baseline
    model_config = ckpt.config
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
    tp = config.tensor_parallel_size
    shard = RankShard.of(model_config, tp, 0) if tp > 1 else None  # ranks hold equal shares: the driver's bounds all
    plan = plan_engine(
        model_config,
        config,
        model_name=name,
        backend=backend.plan_facts(config.dtype),
        grammars=grammars_possible(config, tokenizer),
        baseline_bytes=resident_bytes()[0],
        api_process_bytes=api_process_bytes,
        draft=draft_facts(config),
        **loading.planning_facts(ckpt, config, shard),
    )
    if group is not None:  # every rank loads its shard at once; the cache is the driver's plan's
        group.group.broadcast(RankSetup(config, plan.pool_blocks, plan.block_size, plan.kv_dtype))
    try:
        loaded = loading.load_dir(
            ckpt,
            name,
            config.dtype,
            tokenizer=tokenizer,
            quantization=config.quantization,
            backend=backend,
            shard=shard,
            expert_slots=plan.expert_slots,
            streamed_layers=(plan.resident_layers, plan.layer_slots),
        )
    except Exception as e:
        if group is not None:
            group.group.gather_objects(f"rank 0: {type(e).__name__}: {e}")
        raise
    if group is not None:
        failed = [f for f in group.group.gather_objects(None) if f]
        if failed:
            raise ModelLoadError("a rank of the split model could not load its shard: " + "; ".join(failed))
    return LLMEngine(assemble(loaded, config, plan, grammars, group, None), loaded, grammars, group)
