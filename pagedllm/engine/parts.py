"""The parts of one engine, made from a loaded model, its config and its plan (``assemble``):
the scheduler over its block manager, the KV cache, the runner and its sampler, the threads, a
draft model's own cache, and ``EngineMemory``, the owner of the plan, the cache, the blocks and
the limits, with the policy that moves them (``ElasticMemory``). ``LLMEngine`` drives them;
``build_engine`` plans and loads before any of this exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import structured
from ..backends.base import Backend, ThreadPolicy
from ..engine_config import EngineConfig
from ..errors import UnsupportedModelError
from ..layers.sampler import Sampler
from ..limits import RequestLimits
from ..loading import LoadedModel
from ..memory.budget import total_memory
from ..memory.footprint import RoutedExperts, window_pool_blocks
from ..memory.machine import resident_bytes
from ..memory.planner import AUTO_MAX_BATCH_TOKENS, AUTO_MAX_NUM_SEQS, MemoryPlan, plan_engine
from ..sizes import parse_memory
from ..structured import Grammars
from .block_pools import BlockPools
from .detokenizer import Detokenizer
from .disk_prefix_cache import VERSION as DISK_FORMAT_VERSION
from .disk_prefix_cache import DiskPrefixCache, namespace_of
from .drafter import DraftModel, draft_facts, load_draft
from .elastic import ElasticMemory
from .model_runner import ModelRunner
from .ranks import Ranks
from .resources import EngineMemory
from .scheduler import Scheduler
from .speculative import Speculation


@dataclass
class EngineParts:
    backend: Backend
    memory: EngineMemory
    elastic: ElasticMemory
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    detokenizer: Detokenizer
    drafter: DraftModel | None
    threads: ThreadPolicy
    eos_token_ids: tuple[int, ...]


def assemble(
    loaded: LoadedModel,
    config: EngineConfig,
    plan: MemoryPlan | None,
    grammars: Grammars | None,
    ranks: Ranks | None,
    draft: LoadedModel | None,
) -> EngineParts:
    """Every part of an engine for ``loaded`` under ``config``; without a ``plan``, planned now
    from what the process holds. With a budget the whole KV cache is committed here."""
    cfg, backend = loaded.config, loaded.model.backend
    if draft is None and config.speculative_method == "draft_model":
        draft = load_draft(config, loaded, backend)
    plan = plan or plan_loaded(loaded, backend, config, draft)
    eos = stop_token_ids(cfg, loaded.tokenizer)
    detokenizer = Detokenizer(loaded.tokenizer, eos, plan.max_model_len)
    blocks = _block_pools(cfg, config, plan)
    limits = RequestLimits(cfg.vocab_size, plan.max_num_seqs, plan.max_model_len, plan.num_blocks, plan.block_size)
    drafter = drafter_of(loaded, backend, draft, plan, config) if draft is not None else None
    scheduler = Scheduler(
        blocks,
        plan.max_batch_tokens,
        plan.max_num_seqs,
        detokenizer.check_stop,
        speculation=speculation_of(config),
        max_model_len=plan.max_model_len,
        proposer=drafter,
    )
    if ranks is not None:
        loaded.model.tensor_parallel = ranks.group
    kv_cache = backend.allocate_kv_cache(  # the model's own heads: a rank's, when split
        loaded.model.config,
        plan.pool_blocks,
        plan.block_size,
        plan.kv_dtype,
        resident=config.budgeted,
        capacity_blocks=pool_capacity(plan),  # set_memory's room
        state_slots=blocks.state_slots,
        checkpoint_slots=blocks.checkpoints.slots if blocks.checkpoints is not None else 0,
    )
    if config.prefix_cache_dir is not None:
        blocks.attach_disk(disk_tier(loaded, config, plan, kv_cache))
    memory = EngineMemory(
        plan, config, kv_cache, blocks, limits, scheduler, replanner(loaded, backend), loaded.model.expert_cache
    )
    sampler = Sampler(eos, grammars, backend)
    cpus = ranks.cpus if ranks is not None else None
    return EngineParts(
        backend=backend,
        memory=memory,
        elastic=ElasticMemory(memory, str(backend.device), _budget_fixed(ranks, drafter)),
        scheduler=scheduler,
        runner=ModelRunner(loaded.model, kv_cache, sampler, backend),
        sampler=sampler,
        detokenizer=detokenizer,
        drafter=drafter,
        threads=backend.thread_policy(config.threads or (len(cpus) if cpus else None), cpus=cpus),
        eos_token_ids=eos,
    )


def disk_tier(loaded: LoadedModel, config: EngineConfig, plan: MemoryPlan, kv_cache) -> DiskPrefixCache:
    """The prefix cache's disk tier for this model and these settings (``disk_prefix_cache``)."""
    cfg = loaded.config
    if len(cfg.kv_pools) > 1 or cfg.state_bytes_per_sequence():
        raise UnsupportedModelError(
            f"{cfg.architecture}: the prefix cache's disk tier keeps blocks of full attention only; this model has "
            "sliding-window layers or layers that keep a state per sequence (not implemented yet)"
        )
    settings = {
        "dtype": config.dtype,
        "kv_dtype": plan.kv_dtype,
        "block_size": plan.block_size,
        "quantization": config.quantization,
        "block_bytes": kv_cache.block_nbytes(0),
        "format": DISK_FORMAT_VERSION,
    }
    namespace = namespace_of(loaded.path, settings)
    assert config.prefix_cache_dir is not None
    return DiskPrefixCache(config.prefix_cache_dir, parse_memory(config.prefix_cache_disk), namespace, kv_cache)


def _budget_fixed(ranks: Ranks | None, drafter) -> str | None:
    """Why the budget cannot change at run time, or None where it can (``ElasticMemory``)."""
    if ranks is not None:
        return "a split model's budget cannot change at run time yet"
    if drafter is not None:
        return "with a draft model the budget cannot change at run time yet"
    return None


def plan_loaded(loaded: LoadedModel, backend: Backend, config: EngineConfig, draft: LoadedModel | None) -> MemoryPlan:
    """The plan when the model (and draft) are loaded already: the baseline is what the
    process holds besides them."""
    weights = loaded.model.weight_bytes()  # (the draft's: draft_facts reads its checkpoint)
    held = weights + (draft.model.weight_bytes() if draft is not None else 0)
    return _plan(loaded, backend, config, weights, max(0, resident_bytes()[0] - held), already_loaded=held)


def _plan(
    loaded: LoadedModel,
    backend: Backend,
    config: EngineConfig,
    weights_bytes: int | None,
    baseline_bytes: int,
    already_loaded: int = 0,
    api_process_bytes: int = 0,
    routed: RoutedExperts | None = None,
) -> MemoryPlan:
    """``plan_engine`` with what the loaded model says of itself."""
    return plan_engine(
        loaded.config,
        config,
        model_name=loaded.name,
        backend=backend.plan_facts(config.dtype),
        grammars=grammars_possible(config, loaded.tokenizer),
        weights_bytes=weights_bytes,
        quantized_weights=loaded.model.quantized(),
        baseline_bytes=baseline_bytes,
        already_loaded=already_loaded,
        api_process_bytes=api_process_bytes,
        draft=draft_facts(config),
        routed=routed,
    )


def drafter_of(
    loaded: LoadedModel, backend: Backend, draft: LoadedModel, plan: MemoryPlan, config: EngineConfig
) -> DraftModel:
    """The draft model over a cache of its own, as many blocks as the model's (the plan
    counts one of each)."""
    cache = backend.allocate_kv_cache(
        draft.model.config, plan.num_blocks, plan.block_size, plan.kv_dtype, resident=config.budgeted
    )
    return DraftModel(
        draft.model,
        cache,
        backend,
        plan.max_batch_tokens,
        loaded.config.vocab_size,
        stop_token_ids(loaded.config, loaded.tokenizer),
    )


def _block_pools(cfg, config: EngineConfig, plan: MemoryPlan) -> BlockPools:
    """The blocks of every KV pool, and the state and checkpoint slots of a model that keeps states."""
    states = _state_slots(cfg, config, plan)
    checkpoints = plan.checkpoint_slots if states and config.enable_prefix_caching else 0
    return BlockPools(
        plan.pool_blocks, plan.block_size, cfg.kv_pools, config.enable_prefix_caching, states, checkpoints
    )


def _state_slots(cfg, config: EngineConfig, plan: MemoryPlan) -> int:
    """One state slot per sequence that may run at once, for a model whose layers keep a state
    per sequence (the plan counted them, and its prefix checkpoints: ``MemoryPlan.state_bytes``);
    0 for any other. Such a model takes no speculative guesses (a rejected guess cannot be taken
    back out of a state)."""
    if not cfg.state_bytes_per_sequence():
        return 0
    if config.speculative_method is not None:
        raise UnsupportedModelError(
            f"{cfg.architecture}: speculative decoding is not supported for layers that keep a state per "
            "sequence (a rejected guess cannot be taken back out of the state)"
        )
    return plan.max_num_seqs


def speculation_of(config: EngineConfig) -> Speculation | None:
    if config.speculative_method is None:
        return None
    return Speculation(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


def stop_token_ids(cfg, tokenizer) -> tuple[int, ...]:
    """The tokens that end a sequence: the config's EOS ids and the tokenizer's EOS token."""
    eos = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


def grammars_possible(config: EngineConfig, tokenizer) -> bool:
    """Whether structured output can run in this engine (on, a tokenizer, xgrammar installed):
    its grammar caches are then in the plan."""
    return config.structured_output and tokenizer is not None and structured.available()


def replanner(loaded: LoadedModel, backend: Backend) -> Callable[[EngineConfig, MemoryPlan], MemoryPlan]:
    """``EngineMemory.replan`` for this model: the plan for a config with the process's facts as
    they were when the old plan was made (its baseline, its weights, the API process beside it).
    It holds the model, never the engine: no cycle keeps a dropped engine's cache alive until the
    garbage collector runs (the next engine would plan around it)."""

    def replan(config: EngineConfig, old: MemoryPlan) -> MemoryPlan:
        baseline = old.baseline_bytes - old.api_process_bytes
        weights, routed = old.weights_bytes, None
        cache = loaded.model.expert_cache
        if cache is not None and config.expert_slots is None:  # the experts' share is solved again
            routed = cache.facts
            held = old.expert_slots * old.expert_slot_bytes if old.expert_slots else routed.total_bytes
            weights = old.weights_bytes - held + routed.total_bytes
        return _plan(loaded, backend, config, weights, baseline, api_process_bytes=old.api_process_bytes, routed=routed)

    return replan


def pool_capacity(plan: MemoryPlan) -> list[int]:
    """The most blocks each pool may grow to at a later budget: pool 0 as many as the host's
    memory holds; a window pool what its sequences can hold at once at the largest step budget
    and number of sequences a plan solves for by itself (or this plan's, when larger)."""
    seqs, tokens = max(plan.max_num_seqs, AUTO_MAX_NUM_SEQS), max(plan.max_batch_tokens, AUTO_MAX_BATCH_TOKENS)
    windows = [max(n, window_pool_blocks(w, plan.block_size, tokens, seqs)) for w, n, _ in plan.window_pools]
    return [max(plan.num_blocks, total_memory() // plan.kv_bytes_per_block), *windows]
