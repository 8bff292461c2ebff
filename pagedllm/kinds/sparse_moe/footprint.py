"""The memory of a mixture of experts' phases in a step (``forward.SparseMoE`` as it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...sizes import INDEX_BYTES as INDEX

if TYPE_CHECKING:
    from ...config import ModelConfig
    from ...memory.footprint import LayerTerms


def phases(layer: LayerTerms) -> dict[str, int]:
    """A sparse layer as ``forward.SparseMoE`` runs it, above ``live`` (buffers, residual,
    normed x): the router's float32 input, logits and softmax; then the output accumulator
    and the routing (weights, experts, their order, tokens, sorted weights, the counts) held
    while one expert at a time runs on its gathered rows and its output is added. An expert
    may take from one row to every token: the phases are the worst of every token (the most
    rows) and of the fewest rows that pad to the same GEMM bucket (the most padding)."""
    cfg, t, e, live, g = layer.cfg, layer.t, layer.e, layer.live, layer.gemms
    moe = cfg.moe
    assert moe is not None
    h, k, experts = cfg.hidden_size, moe.top_k, moe.num_experts
    logits = t * h * 4 * (e != 4) + t * experts * (4 + 4)  # x in float32 unless it is
    routing = t * k * (e + INDEX) + 3 * t * k * INDEX + t * k * e + experts * INDEX
    held = live + t * h * e + routing  # the accumulator and the routing
    phases = {"moe router": live + logits + t * k * (4 + INDEX)}
    # each routed expert on c of the tokens' rows (gathered); the shared one on every row, as is
    mlps = [(c, moe.expert_size, c * h * e) for c in {t, g.fewest_rows_alike(t)}]
    if moe.shared_expert_size:  # its sigmoid gate [t, 1] and that gate's product with its output
        mlps.append((t, moe.shared_expert_size, (2 * t * e + 64) * moe.shared_expert_gated))
    for c, width, rows in mlps:
        base = held + rows
        up = g.rows_of(c, h, 2 * width) * 2 * width * e
        candidates = {
            "moe expert gate/up": base + g.bytes(c, h, 2 * width),
            "moe expert silu * up": base + up + c * width * e,
            "moe expert down": base + c * width * e + g.bytes(c, width, h),
        }
        for name, value in candidates.items():
            phases[name] = max(phases.get(name, 0), value)
    if moe.shared_expert_size:  # its output, then the gate times it (ungated, Granite's: its output, then added)
        gate = (2 * t * e + 64) * moe.shared_expert_gated
        phases["moe shared expert gated"] = held + gate + 2 * t * h * e
    return phases


def _widths(cfg: ModelConfig) -> list[int]:
    """Every expert's intermediate width, and the shared expert's."""
    moe = cfg.moe
    assert moe is not None
    return [moe.expert_size] * moe.num_experts + ([moe.shared_expert_size] if moe.shared_expert_size else [])


def matrices(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(rows, columns) of each expert's gate/up (stacked) and down (the router aside: it stays float)."""
    return [m for i in _widths(cfg) for m in ((2 * i, cfg.hidden_size), (cfg.hidden_size, i))]


def parameters(cfg: ModelConfig, layer: int) -> int:
    """The experts, their biases, the router (and a shared expert's gate)."""
    moe, h = cfg.moe, cfg.hidden_size
    assert moe is not None
    experts = sum(r * c for r, c in matrices(cfg, layer))
    biases = sum(2 * i + h for i in _widths(cfg)) * cfg.mlp_bias
    gate = h * bool(moe.shared_expert_size and moe.shared_expert_gated)
    return experts + biases + (h + moe.router_bias) * moe.num_experts + gate
