"""Residency: how much of a model stays loaded when its weights and one request's cache do not
fit together. A mixture keeps some routed experts resident and reads the rest from the file
(``layers/expert_cache.py``); a dense model keeps its first layers and reads the others into
slots every step (``layers/layer_stream.py``). Each solver gives the costs with only what stays
among the weights, which the solve and its refusal then take."""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from ..sizes import ceil_div
from .costs import AUTO_MAX_BATCH_TOKENS, EXPERT_CACHE_CONTEXT, Costs, overhead
from .footprint import RoutedExperts, StreamableLayers, activation_peak


def expert_residency(
    costs: Costs, budget: int, given_len: int | None, model_len: int, max_batch_tokens: int | None, fail
) -> tuple[int, Costs]:
    """(how many routed experts stay resident, the costs with only those among the weights, which
    the failure's figures take too): 0 (all loaded) unless ``expert_slots`` bounds them or every
    expert resident leaves no room for one request of ``context`` tokens (min(the model's, 4096)
    unless max_model_len says)."""
    s, experts = costs.s, costs.s.routed_experts
    context = given_len or min(model_len, EXPERT_CACHE_CONTEXT)
    m = max_batch_tokens or AUTO_MAX_BATCH_TOKENS
    if experts is None:
        return 0, costs
    one_request = costs.kv(ceil_div(context, s.block_size), m) + activation_peak(costs.cfg, s, m, costs.seqs, context)
    if not s.expert_slots and costs.baseline + costs.weights + overhead(s) + one_request <= budget:
        return 0, costs
    slots = _expert_slots(costs, experts, budget, context, m, fail)
    if slots >= experts.count:
        return 0, costs
    resident = costs.weights - s.draft_weights_bytes - experts.total_bytes
    fail.costs = replace(costs, s=replace(s, weights_bytes=resident + slots * experts.slot_bytes))
    return slots, fail.costs


def _expert_slots(costs: Costs, experts: RoutedExperts, budget: int, context: int, m: int, fail) -> int:
    """How many routed experts stay resident: the user's bound, else as many as the budget holds
    beside everything else with a cache for one request of ``context`` tokens (the solve then
    gives the cache what is left); fewer than the floor does not plan."""
    s = costs.s
    if s.expert_slots is not None:
        if s.expert_slots < experts.floor:
            fail(
                f"expert_slots={s.expert_slots} is below the {experts.floor} experts a step's layer may choose at once"
            )
        return s.expert_slots
    resident = costs.weights - experts.total_bytes
    kv = costs.kv(ceil_div(context, s.block_size), m)
    need = costs.baseline + resident + activation_peak(costs.cfg, s, m, costs.seqs, context) + overhead(s) + kv
    slots = max(0, budget - need) // experts.slot_bytes
    if slots < experts.floor:  # the figures the error gives: with the smallest expert cache
        fail.costs = replace(costs, s=replace(s, weights_bytes=resident + experts.floor * experts.slot_bytes))
        fail(
            f"the weights exceed the budget, and beside what every token reads the budget holds {slots} of the "
            f"{experts.count} routed experts, fewer than the {experts.floor} a step's layer may choose at once"
        )
    return slots


def expert_plan_fields(cfg: ModelConfig, experts: RoutedExperts | None, slots: int) -> dict:
    """MemoryPlan's expert fields."""
    if not slots or experts is None or cfg.moe is None:
        return {}
    chosen_per_token = cfg.moe.top_k * sum(cfg.moe.layers)
    missed = chosen_per_token * (experts.count - slots) / experts.count
    return {
        "expert_slots": slots,
        "routed_experts": experts.count,
        "expert_slot_bytes": experts.slot_bytes,
        "expert_reads_per_token": int(missed * experts.slot_bytes),
    }


def layer_residency(
    costs: Costs, budget: int, given_len: int | None, model_len: int, max_batch_tokens: int | None, fail
) -> tuple[tuple[int, int], Costs]:
    """((resident layers, slots), the costs with only those among the weights) where a dense
    model's last layers are read from the file every step; ((0, 0), costs) where all load.

    Every step reads every streamed layer, so no cache of layers helps: as many whole layers stay
    resident as fit beside a cache for one request of ``context`` tokens (the solve then gives the
    KV cache what is left), the first ones, and the others take turns in two slots (one read
    ahead while the other computes), or one where two do not fit. ``plan`` asks this only where
    every layer resident does not plan, or ``resident_layers`` says how many stay (-1: solve)."""
    s, layers = costs.s, costs.s.streamable_layers
    if layers is None or s.resident_layers is None:
        return (0, 0), costs
    sizes, count = layers.layer_bytes, len(layers.layer_bytes)
    if 0 <= s.resident_layers < count:
        resident, slots = s.resident_layers, min(2, count - s.resident_layers)
    elif s.resident_layers >= count:
        return (0, 0), costs
    else:
        context = given_len or min(model_len, EXPERT_CACHE_CONTEXT)
        m = max_batch_tokens or AUTO_MAX_BATCH_TOKENS
        one_request = costs.kv(ceil_div(context, s.block_size), m)
        one_request += activation_peak(costs.cfg, s, m, costs.seqs, context)
        room = budget - (costs.baseline + costs.weights - sum(sizes) + overhead(s) + one_request)
        fits = [(r, k) for k in (2, 1) for r in range(count - k, -1, -1) if _held(sizes, r, k) <= room]
        if not fits:
            fail.costs = replace(costs, s=replace(s, weights_bytes=costs.weights - sum(sizes) + max(sizes)))
            fail(
                "the weights exceed the budget, and beside what every step reads the budget holds no slot for one "
                f"decoder layer read from the file ({max(sizes) / 1024**2:.0f} MiB) with a cache for {context} tokens"
            )
        resident, slots = fits[0]
    weights = costs.weights - sum(sizes) + _held(sizes, resident, slots)
    fail.costs = replace(costs, s=replace(s, weights_bytes=weights))
    return (resident, slots), fail.costs


def _held(sizes: tuple[int, ...], resident: int, slots: int) -> int:
    """The layers' bytes in memory with the first ``resident`` loaded and the rest in ``slots`` slots."""
    return sum(sizes[:resident]) + slots * max(sizes[resident:])


def layer_plan_fields(layers: StreamableLayers | None, layer_plan: tuple[int, int]) -> dict:
    """MemoryPlan's layer fields."""
    resident, slots = layer_plan
    if not slots or layers is None:
        return {}
    streamed = layers.layer_bytes[resident:]
    return {
        "resident_layers": resident,
        "model_layers": len(layers.layer_bytes),
        "layer_slots": slots,
        "layer_slot_bytes": max(streamed),
        "layer_reads_per_step": sum(streamed),
    }
