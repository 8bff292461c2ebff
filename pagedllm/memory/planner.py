"""The memory planner: solves the footprint polynomial (``footprint``) for what the user left
unset, under a budget (``budget``); says in GiB what does not fit and what would.

Pure arithmetic over ``ModelConfig``: no torch, no engine imports, no weights. One job per module:

- ``planner`` (here): the doors (``plan_engine``, ``plan_for``) and the solve (``plan``);
- ``costs``: the footprint of one configuration as the solve sees it, and the auto sizes;
- ``residency``: how many routed experts or decoder layers stay loaded when not all fit;
- ``refusal``: the error when nothing fits, with the sizes that would;
- ``memory_plan``: the result, and its report (``pagedllm plan``'s table).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from .. import backends
from ..config import ModelConfig
from ..distributed.shards import rank_config, shard_layout
from ..engine_config import ConfigError, EngineConfig
from ..errors import CacheDoesNotFitError
from ..sizes import GRAMMAR_CACHE_BYTES, QUANTIZED, ceil_div
from .budget import resolve_budget
from .costs import (
    AUTO_MAX_BATCH_TOKENS,
    AUTO_MAX_NUM_SEQS,
    DISK_TIER_WRITE_BUFFER_BYTES,
    ESTIMATED_BASELINE_BYTES,
    OVERHEAD_BYTES,
    Costs,
    overhead,
)
from .footprint import (
    EngineSettings,
    RoutedExperts,
    StreamableLayers,
    activation_peak,
    kv_bytes_per_block,
    loader_bytes,
)
from .machine import usable_cpus
from .memory_plan import MemoryPlan
from .refusal import Refusal
from .residency import expert_plan_fields, expert_residency, layer_plan_fields, layer_residency

if TYPE_CHECKING:
    from ..backends.facts import PlanFacts

__all__ = [
    "AUTO_MAX_BATCH_TOKENS",
    "AUTO_MAX_NUM_SEQS",
    "OVERHEAD_BYTES",
    "MemoryPlan",
    "overhead",
    "plan",
    "plan_engine",
]


def plan(
    cfg: ModelConfig,
    budget_bytes: int,
    *,
    budget_source: str = "given",
    model_name: str = "model",
    settings: EngineSettings | None = None,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_num_seqs: int | None = None,
    cap_blocks: int | None = None,
    baseline_bytes: int = 0,
    baseline_source: str = "not counted",
) -> MemoryPlan:
    """Solves for what the user left unset; raises CacheDoesNotFitError if nothing fits.

    ``budget_bytes`` bounds the whole process: ``baseline_bytes`` (the process before loading)
    plus everything the engine adds. N = num_blocks, M = max_batch_tokens, L = max_model_len:

    - N and M given: checked. One given: the other is the largest that fits. Neither: M =
      AUTO_MAX_BATCH_TOKENS (smaller if one block does not fit), N the largest that fits.
    - L given (``settings.max_model_len``): the cache must hold one request of L tokens, else
      the error says which L fits. L unset: the model's context, or, if the cache is smaller,
      the longest context the cache holds (a solved N is solved together with it).
    - S unset: AUTO_MAX_NUM_SEQS, or N when the cache has fewer blocks (each running sequence
      holds one, so no more ever run at once), freeing their logits and sampler rows.
    Results are integers, rounded down, never above the budget, and maximal (one more block or
    token would not fit). ``cap_blocks`` bounds a solved N (more could never be used at once)."""
    s = settings or EngineSettings()
    model_len = cfg.max_position_embeddings
    given_len = min(s.max_model_len, model_len) if s.max_model_len else None
    costs = Costs(cfg, s, max_num_seqs or AUTO_MAX_NUM_SEQS, baseline_bytes, loader_bytes(cfg, s))
    fail = Refusal(costs, budget_bytes, budget_source, num_blocks, max_batch_tokens, given_len or model_len)
    slots, costs = expert_residency(costs, budget_bytes, given_len, model_len, max_batch_tokens, fail)
    layer_plan, costs = layer_residency(costs, budget_bytes, given_len, model_len, max_batch_tokens, fail)
    if costs.baseline + costs.weights + overhead(s) > budget_bytes:
        fail("the process baseline and the weights alone exceed the budget")
    solve = partial(
        _solve,
        budget=budget_bytes,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        given_len=given_len,
        cap=cap_blocks if cap_blocks is not None else 1 << 62,
        fail=fail,
    )
    n, m, max_len = solve(costs)
    if max_num_seqs is None and n < costs.seqs:
        costs = _fewer_seqs(costs, solve)
        fail.costs = costs
        n, m, max_len = solve(costs)
    source = "given" if given_len else ("the model's" if max_len == model_len else "solved: what the cache holds")
    residency = {
        **expert_plan_fields(cfg, s.routed_experts, slots),
        **layer_plan_fields(s.streamable_layers, layer_plan),
    }
    return _result(
        costs, (n, m, max_len), (model_name, budget_bytes, budget_source, source, baseline_source), residency
    )


def _result(costs: Costs, solved: tuple[int, int, int], names: tuple[str, int, str, str, str], residency: dict):
    """The MemoryPlan of a solve: (N, M, L), and (model, budget, its source, L's source, the baseline's source)."""
    (n, m, max_len), (model_name, budget_bytes, budget_source, len_source, baseline_source) = solved, names
    s = costs.s
    return MemoryPlan(
        model_name,
        budget_bytes,
        budget_source,
        n,
        s.block_size,
        m,
        costs.seqs,
        max_len,
        len_source,
        s.dtype,
        s.kv,
        costs.baseline,
        baseline_source,
        costs.weights,
        costs.kv(n, m),
        costs.per_block,
        activation_peak(costs.cfg, s, m, costs.seqs, max_len),
        overhead(s),
        costs.loader,
        _weights_format(s),
        disk_tier_bytes=s.disk_tier_bytes,
        draft_weights_bytes=s.draft_weights_bytes,
        draft_kv_bytes_per_block=s.draft_kv_bytes_per_block,
        window_pools=tuple((w, n_w, b) for (w, b), n_w in zip(costs.windows, costs.window_blocks(n, m))),
        shared_pool_tokens=costs.shared_pool_tokens(budget_bytes, m, max_len),
        state_bytes=costs.states,
        checkpoint_slots=costs.checkpoint_slots,
        **residency,
    )


def _all_resident_else_streamed(cfg: ModelConfig, budget: int, *, settings: EngineSettings, **arguments) -> MemoryPlan:
    """The plan with every layer resident; where that does not fit, with the last layers read
    from the file every step (as many resident as fit); where neither does, the first's error."""
    try:
        return plan(cfg, budget, settings=replace(settings, streamable_layers=None), **arguments)
    except CacheDoesNotFitError as refused:
        try:
            return plan(cfg, budget, settings=replace(settings, resident_layers=-1), **arguments)  # -1: solve
        except CacheDoesNotFitError:
            raise refused from None


def _fewer_seqs(costs: Costs, solve) -> Costs:
    """Every running sequence holds a block, so no more than N ever run at once: a solved
    max_num_seqs above N only reserves logits and sampler rows that never exist. The largest S
    whose cache still has S blocks (fewer rows reserved, more blocks)."""
    lo, hi = 1, costs.seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if solve(replace(costs, seqs=mid))[0] >= mid:
            lo = mid
        else:
            hi = mid - 1
    return replace(costs, seqs=lo)


def _weights_format(s: EngineSettings) -> str:
    if not s.quantized_weights:
        return ""
    kind = s.quantization if s.quantization in QUANTIZED else "quantized as stored"
    return f"{kind} weights, {s.dtype} activations"


def _solve(
    costs: Costs,
    *,
    budget: int,
    num_blocks: int | None,
    max_batch_tokens: int | None,
    given_len: int | None,
    cap: int,
    fail: Refusal,
) -> tuple[int, int, int]:
    """(N, M, L) for one max_num_seqs: see ``plan``."""
    s, model_len = costs.s, costs.cfg.max_position_embeddings
    max_len = given_len or model_len
    if num_blocks is not None:
        n = num_blocks
        if given_len is None:
            max_len = min(model_len, n * s.block_size)
        m = max_batch_tokens or costs.largest_m(budget, n, max_len, max(1, budget))
        if m == 0:
            fail(f"num_blocks={num_blocks} leaves no room for even one token per step")
    else:
        # With a given L, the largest M under AUTO that still fits its request; if none does,
        # the M that fits one block, so the error below is about the context, not the step.
        m = max_batch_tokens or _auto_m(costs, budget, max_len if given_len else 1) or _auto_m(costs, budget, 1)
        if m == 0:
            fail("not even one block and one token per step fit")
        if given_len is None:
            max_len = costs.longest_context(budget, m, model_len)
            if max_len == 0:
                fail(f"max_batch_tokens={m} leaves no room for even one block")
        n = min(cap, costs.largest_n(budget, m, max_len))
    if costs.total(n, m, max_len) > budget:
        fail("the requested sizes exceed the budget", n=n, m=m)
    if n * s.block_size < max_len:
        fail(
            f"the KV cache ({n} blocks x {s.block_size} = {n * s.block_size} tokens) cannot hold one request of "
            f"max_model_len={max_len} tokens ({ceil_div(max_len, s.block_size)} blocks)",
            n=n,
            m=m,
        )
    return n, m, max_len


def _auto_m(costs: Costs, budget: int, min_tokens: int) -> int:
    """AUTO_MAX_BATCH_TOKENS, or the largest M below it with which a cache of ``min_tokens``
    still fits (0 if none)."""
    blocks = ceil_div(min_tokens, costs.s.block_size)
    return costs.largest_m(budget, blocks, max(min_tokens, costs.s.block_size), AUTO_MAX_BATCH_TOKENS)


def _one_rank(
    cfg: ModelConfig, c: EngineConfig, weights_bytes: int | None, quantized_weights: bool | None
) -> tuple[ModelConfig, dict]:
    """The config one of ``c.tensor_parallel_size`` ranks runs, and the EngineSettings fields of
    the split (none at tp=1): the driver gathers every rank's logits, the padded vocabulary wide.
    Weights stored quantized are sized from the checkpoint's header (``weights_bytes``, the
    rank's share)."""
    tp = c.tensor_parallel_size
    if tp == 1:
        return cfg, {}
    if quantized_weights and c.quantization not in QUANTIZED and weights_bytes is None:
        raise ConfigError(
            "tensor_parallel_size", "planning a split of weights stored quantized (a GGUF) needs the checkpoint"
        )
    return rank_config(cfg, tp), {"tensor_parallel": tp, "gathered_vocab": shard_layout(cfg, tp).padded_vocab}


def plan_engine(
    cfg: ModelConfig,
    config: EngineConfig | None = None,
    *,
    model_name: str = "model",
    backend: PlanFacts | None = None,
    baseline_bytes: int | None = None,
    already_loaded: int = 0,
    weights_bytes: int | None = None,
    quantized_weights: bool | None = None,
    grammars: bool = False,
    api_process_bytes: int = 0,
    draft: tuple[ModelConfig, int] | None = None,
    routed: RoutedExperts | None = None,
    layers: StreamableLayers | None = None,
) -> MemoryPlan:
    """The one way an engine is planned (``build_engine`` before loading, ``LLMEngine`` after and at
    each new budget, ``pagedllm plan`` without weights): the budget, then ``plan``. Everything the
    user chose is in ``config`` (default: ``EngineConfig()``); the rest are facts of this process
    and checkpoint (``loading.planning_facts`` reads the checkpoint's).

    ``config.memory`` bounds the whole process, ``baseline_bytes`` (its resident memory before any
    weight is loaded; estimated when not given) included. ``config.memory_fraction`` is a fraction
    of the memory free now (host or container), which the baseline has already taken, so the process
    may reach ``baseline + fraction x free``. ``already_loaded``: weights the caller holds already,
    counted as free. ``backend``: the kernels, the bf16 GEMMs' kind and whether quantized rows run
    on AMX tiles (``Backend.plan_facts``; default: ``backends.facts``, the device's own guess
    without torch). ``weights_bytes``: the weights' exact size when the checkpoint is at hand (else
    computed from the config; with ``tensor_parallel_size`` > 1, one rank's share);
    ``quantized_weights``: whether they run quantized (default: when ``config.quantization`` says
    so).
    ``grammars``: structured output can be used (on, with a tokenizer and xgrammar): its caches'
    bound is counted in the overhead. ``api_process_bytes``: the peak of the server's API process
    when the engine runs in its own (``engine_process``): the budget bounds the sum of both
    processes, so it joins the baseline. ``draft``: a draft model's config and weights' bytes.
    ``routed``: a mixture's routed experts as the checkpoint stores them
    (``loading.routed_experts``), which may then stay in the file when the weights exceed the budget
    (or ``config.expert_slots`` bounds them). ``layers``: a dense model's layers as stored
    (``loading.streamable_layers``): the last ones may then be read from the file every step, where
    every layer resident does not plan (or ``config.resident_layers`` says how many stay).
    """
    c = config or EngineConfig()
    cfg, split = _one_rank(cfg, c, weights_bytes, quantized_weights)
    baseline = (baseline_bytes if baseline_bytes is not None else ESTIMATED_BASELINE_BYTES) + api_process_bytes
    budget, source = _budget(c, backend, already_loaded, baseline)
    settings = _settings(c, backend, weights_bytes, quantized_weights, GRAMMAR_CACHE_BYTES if grammars else 0, split)
    settings = _with_residency(settings, c, routed, layers)
    if draft is not None:
        settings = _with_draft(settings, cfg, *draft)
    measured_source = ("measured" if baseline_bytes is not None else "estimated") + (
        f", with the API process's {api_process_bytes / 1024**2:.0f} MiB" if api_process_bytes else ""
    )
    result = _solved(cfg, c, settings, (budget, source), (baseline, measured_source), model_name)
    return replace(result, api_process_bytes=api_process_bytes, tensor_parallel_size=c.tensor_parallel_size)


def _solved(
    cfg: ModelConfig,
    c: EngineConfig,
    settings: EngineSettings,
    budget: tuple[int, str],
    baseline: tuple[int, str],
    model_name: str,
) -> MemoryPlan:
    """``plan`` for the user's sizes ((bytes, source) of the budget and of the baseline). With no
    budget given, a solved cache is capped at what ``max_num_seqs`` requests of ``max_model_len``
    tokens can use at once; a dense model that may stream its layers is planned resident first."""
    seqs = c.max_num_seqs or AUTO_MAX_NUM_SEQS
    longest = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    cap = seqs * ceil_div(longest, c.block_size) if not c.budgeted else None
    solver = _all_resident_else_streamed if settings.streamable_layers and c.resident_layers is None else plan
    return solver(
        cfg,
        budget[0],
        budget_source=budget[1],
        model_name=model_name,
        settings=settings,
        num_blocks=c.num_blocks,
        max_batch_tokens=c.max_batch_tokens,
        max_num_seqs=c.max_num_seqs,
        cap_blocks=cap,
        baseline_bytes=baseline[0],
        baseline_source=baseline[1],
    )


def disk_tier_bytes(c: EngineConfig) -> int:
    """What the prefix cache's disk tier holds in RAM: its write buffer at its bound and the
    block it reads into (at most 16 MiB; a block is under 1 MiB for models up to 8B at block size 16)."""
    return DISK_TIER_WRITE_BUFFER_BYTES + 16 * 1024**2 if c.prefix_cache_dir is not None else 0


def _settings(
    c: EngineConfig,
    backend: PlanFacts | None,
    weights_bytes: int | None,
    quantized_weights: bool | None,
    grammar_cache_bytes: int,
    split: dict,
) -> EngineSettings:
    """What the footprint depends on, from the user's config and this process's facts."""
    assumed = backends.facts(c.backend, c.dtype)  # `pagedllm plan`: the device's facts, without torch
    facts = backend or assumed
    isa = facts.gemm_kind or assumed.gemm_kind or "avx2"
    settings = EngineSettings(
        dtype=c.dtype,
        kv_dtype=c.kv_cache_dtype,
        block_size=c.block_size,
        max_model_len=c.max_model_len,
        device=facts.device,
        gemm_isa=isa,
        kernels=facts.kernels,
        threads=c.threads or usable_cpus(),
        quantization=c.quantization,
        weights_bytes=weights_bytes,  # one rank's when split (``checkpoint_weights`` with its shard)
        quantized_weights=c.quantization in QUANTIZED if quantized_weights is None else quantized_weights,
        packed=backends.workspace(facts.device).packs_weights(isa, c.dtype),
        amx_tiles=facts.amx_tiles,
        quant_float_max_rows=facts.quant_float_max_rows,
        own_int8_sums=facts.own_int8_sums,
        grammar_cache_bytes=grammar_cache_bytes,
        state_checkpoints=c.state_checkpoints,
        disk_tier_bytes=disk_tier_bytes(c),
        **split,
    )
    return settings


def _budget(c: EngineConfig, backend: PlanFacts | None, already_loaded: int, baseline: int) -> tuple[int, str]:
    """The whole process's budget and where it came from; with none given (a fraction of what is
    free now), the baseline the process holds already joins it."""
    budget, source = resolve_budget(
        c.memory, c.memory_fraction, "cpu" if backend is None else backend.device, already_loaded
    )
    if c.memory is None:
        return budget + baseline, f"{source} + the process baseline"
    return budget, source


def _with_residency(
    s: EngineSettings, c: EngineConfig, routed: RoutedExperts | None, layers: StreamableLayers | None
) -> EngineSettings:
    """The settings with what may stay in the checkpoint (one process's model: a split keeps all)."""
    if routed is not None and c.tensor_parallel_size == 1:
        s = replace(s, routed_experts=routed, expert_slots=c.expert_slots)
    if layers is not None and c.tensor_parallel_size == 1:
        s = replace(s, streamable_layers=layers, resident_layers=c.resident_layers)
    return s


def _with_draft(s: EngineSettings, cfg: ModelConfig, draft: ModelConfig, draft_weights: int) -> EngineSettings:
    """The settings with a draft model's weights and its K/V beside each block. The plan bounds
    the draft's passes by the model's activation term: so no width of the draft may exceed the
    model's (a draft is the smaller model anyway)."""
    widths = {
        "hidden_size": (draft.hidden_size, cfg.hidden_size),
        "intermediate_size": (draft.intermediate_size, cfg.intermediate_size),
        "attention width": (draft.num_heads * draft.head_dim, cfg.num_heads * cfg.head_dim),
        "vocab_size": (draft.vocab_size, cfg.vocab_size),
    }
    wider = [f"{name} {mine} > {theirs}" for name, (mine, theirs) in widths.items() if mine > theirs]
    if wider:
        raise ConfigError("draft_model", "the draft model is wider than the model: " + ", ".join(wider))
    return replace(
        s, draft_weights_bytes=draft_weights, draft_kv_bytes_per_block=kv_bytes_per_block(draft, s.block_size, s.kv)
    )
