"""How a decoder splits over N tensor-parallel ranks (Megatron's scheme), as plain arithmetic.

Nothing here imports torch or needs weights: the planner sizes a rank of a 70B model from its
config.json alone, and the loader asks which rows of each checkpoint tensor a rank reads.

- q/k/v and gate/up are column-parallel: each rank computes its own heads and its own slice of
  the MLP's inner width; o and down are row-parallel: each rank multiplies its slice of their
  input and the partial outputs are summed by one all-reduce each.
- KV heads split with the query heads that read them. When there are fewer KV heads than ranks,
  each KV head is replicated on ``tp / kv_heads`` consecutive ranks (the ranks whose query heads
  it serves), so every rank still holds exactly one.
- The embedding and the LM head are vocab-parallel: the vocabulary is padded to a multiple of
  ``VOCAB_ALIGN * tp`` (each rank's rows a multiple of 16, as the packed GEMM wants), each rank
  holds one contiguous range of rows, and the padding rows are masked out of the logits. A tied
  LM head shares its rank's embedding rows.
- A mixture of experts splits every expert as the MLP is split (gate/up by their output rows,
  down by its input columns), so each rank computes its columns of whichever experts a token
  chose and the one all-reduce after the layer sums them; the router is replicated (every rank
  routes alike). Whole experts dealt to ranks instead would leave a rank idle whenever a token's
  experts all sit elsewhere (at one decode token, most ranks); not measured against it yet.
- Norms (and Qwen3's per-head q/k norms) are replicated; so are the biases of the row-parallel
  layers (added once, after the all-reduce). gpt-oss's attention sinks, one per query head, go
  with their heads.

A tensor-parallel size that does not divide the heads, the KV heads (or is not a multiple of
them), the MLP width or an expert's width is refused at once, naming the numbers and the sizes that would work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..errors import PagedLLMError
from ..sizes import ceil_div

VOCAB_ALIGN = 16  # rows of a rank's embedding / LM-head shard: a multiple of this


class TensorParallelError(PagedLLMError, ValueError):
    """The model cannot be split over that many ranks."""


@dataclass(frozen=True)
class ShardLayout:
    """What each of ``tp`` ranks holds of one model (the same sizes on every rank)."""

    tp: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank
    kv_replicas: int  # ranks that hold each KV head (1 unless the model has fewer than tp)
    intermediate: int  # the MLP's inner width per rank
    expert: int  # each routed expert's inner width per rank (a mixture of experts; else 0)
    shared_expert: int  # Qwen2-MoE's shared expert's, likewise
    vocab: int  # embedding / LM-head rows per rank
    padded_vocab: int  # vocab * tp: the model's vocabulary plus the masked padding rows

    def head_range(self, rank: int) -> range:
        """The query heads rank ``rank`` computes."""
        return range(rank * self.heads, (rank + 1) * self.heads)

    def kv_head_range(self, rank: int) -> range:
        """The KV heads rank ``rank`` holds (one, shared with its neighbours, when replicated)."""
        first = rank // self.kv_replicas * self.kv_heads
        return range(first, first + self.kv_heads)

    def intermediate_range(self, rank: int) -> range:
        """Its columns of gate and of up (each), which are its rows of down's input."""
        return range(rank * self.intermediate, (rank + 1) * self.intermediate)

    def vocab_range(self, rank: int, vocab_size: int) -> range:
        """Its rows of the embedding and the LM head that are real tokens (the rest of its
        ``vocab`` rows, at the end of the last ranks, are padding)."""
        start = rank * self.vocab
        return range(min(start, vocab_size), min(start + self.vocab, vocab_size))


def shard_layout(cfg: ModelConfig, tp: int) -> ShardLayout:
    """The split of ``cfg`` over ``tp`` ranks, or TensorParallelError naming what does not divide."""
    if tp < 1:
        raise TensorParallelError(f"tensor_parallel_size must be 1 or more, got {tp}")
    if tp > 1 and (why := cfg.family.not_split_because) is not None:
        raise TensorParallelError(
            f"tensor_parallel_size={tp}: {cfg.architecture}'s {why}, which pagedllm does not split over "
            "ranks yet; run it with tensor_parallel_size=1"
        )
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"its {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"its {kv} KV heads (tp must divide them, or be a multiple of them)")
    if cfg.intermediate_size % tp:
        problems.append(f"its MLP width of {cfg.intermediate_size}")
    for width, what in _expert_widths(cfg):
        if width % tp:
            problems.append(f"its {what} width of {width}")
    if problems:
        fits = [n for n in range(1, 65) if _divides(cfg, n)]
        raise TensorParallelError(
            f"tensor_parallel_size={tp} does not split this model: it does not divide "
            f"{' and '.join(problems)}; sizes that do: {', '.join(map(str, fits))}"
        )
    vocab = ceil_div(cfg.vocab_size, VOCAB_ALIGN * tp) * VOCAB_ALIGN
    return ShardLayout(
        tp=tp,
        heads=cfg.num_heads // tp,
        kv_heads=max(1, kv // tp),
        kv_replicas=max(1, tp // kv),
        intermediate=cfg.intermediate_size // tp,
        expert=cfg.moe.expert_size // tp if cfg.moe is not None else 0,
        shared_expert=cfg.moe.shared_expert_size // tp if cfg.moe is not None else 0,
        vocab=vocab,
        padded_vocab=vocab * tp,
    )


def _divides(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_kv_heads
    kv_ok = kv % tp == 0 if kv >= tp else tp % kv == 0
    experts_ok = all(width % tp == 0 for width, _ in _expert_widths(cfg))
    return cfg.num_heads % tp == 0 and cfg.intermediate_size % tp == 0 and kv_ok and experts_ok


def _expert_widths(cfg: ModelConfig) -> list[tuple[int, str]]:
    """A mixture's expert widths that each rank takes a share of (every expert is split, not
    dealt out whole: each rank reads its columns of whichever experts a token chose)."""
    moe = cfg.moe
    if moe is None:
        return []
    return [(moe.expert_size, "experts'")] + (
        [(moe.shared_expert_size, "shared expert's")] if moe.shared_expert_size else []
    )


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one rank runs, as a config: its heads, KV heads, MLP width and vocabulary rows,
    the hidden size whole. Its parameters, KV-cache blocks and step tensors are a rank's (the
    row-parallel outputs are full width: each rank holds the whole sum after the all-reduce)."""
    if tp == 1:
        return cfg
    s = shard_layout(cfg, tp)
    moe = cfg.moe and replace(cfg.moe, expert_size=s.expert, shared_expert_size=s.shared_expert)
    return replace(
        cfg, num_heads=s.heads, num_kv_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab, moe=moe
    )


@dataclass(frozen=True)
class Slice:
    """The part of one checkpoint tensor a rank reads: ``[start, stop)`` along ``dim`` (0: rows,
    1: columns), in the tensor's logical elements. ``zero``: the rank holds zeros of that shape
    instead (a row-parallel layer's bias is added once, by rank 0, not once per rank)."""

    dim: int
    start: int
    stop: int
    total: int  # the tensor's whole length along ``dim``
    zero: bool = False


# Roles of a layer's tensors (``models/family.py``) split by output rows (column-parallel) or by
# input columns (row-parallel), and by what: query heads, KV heads or the MLP's width.
_COLUMN_PARALLEL = {
    "q": "heads",
    "k": "kv",
    "v": "kv",
    "gate": "mlp",
    "up": "mlp",
    "expert_gate": "expert",
    "expert_up": "expert",
    "shared_expert_gate": "shared",
    "shared_expert_up": "shared",
}
_ROW_PARALLEL = {"o": "heads", "down": "mlp", "expert_down": "expert", "shared_expert_down": "shared"}
_PER_HEAD = ("sinks",)  # a value per query head (a parameter of its own, no ``.weight``)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class RankShard:
    """What one rank of a split reads of a checkpoint: ``slice_of`` names its part of each tensor."""

    cfg: ModelConfig  # the whole model's
    layout: ShardLayout
    rank: int

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int, rank: int) -> RankShard:
        return cls(cfg, shard_layout(cfg, tp), rank)

    @property
    def local_config(self) -> ModelConfig:
        return rank_config(self.cfg, self.layout.tp)

    def vocab_range(self) -> range:
        return self.layout.vocab_range(self.rank, self.cfg.vocab_size)

    @property
    def _roles(self) -> dict[str, str]:
        """The family's checkpoint names under ``model.layers.N.`` -> their roles."""
        return {name: role for role, name in self.cfg.family.layer_names.items()}

    def slice_of(self, name: str) -> Slice | None:
        """This rank's part of the HF tensor ``name`` (its logical [rows, columns]), or None when
        every rank holds it whole (norms, Qwen3's per-head q/k norms)."""
        if name in _VOCAB:
            r = self.vocab_range()
            return Slice(0, r.start, r.stop, self.cfg.vocab_size)
        roles = self._roles
        if roles.get(name.split(".", 3)[-1]) in _PER_HEAD:
            heads = self.layout.head_range(self.rank)
            return Slice(0, heads.start, heads.stop, self.cfg.num_heads)
        tensor, _, leaf = name.rpartition(".")
        within = tensor.split(".", 3)[-1] if tensor.startswith("model.layers.") else ""
        role = roles.get(re.sub(r"\.\d+\.", ".{e}.", within))  # an expert's tensor: its role's template
        if role in _COLUMN_PARALLEL:
            r, total = self._range(_COLUMN_PARALLEL[role])
            return Slice(0, r.start, r.stop, total)
        if role in _ROW_PARALLEL:
            r, total = self._range(_ROW_PARALLEL[role])
            if leaf == "bias":  # the output is whole on every rank after the all-reduce
                h = self.cfg.hidden_size
                return Slice(0, 0, h, h, zero=self.rank != 0)
            return Slice(1, r.start, r.stop, total)
        return None

    def range_of(self, kind: str) -> range:
        """The rank's part of a split width: "heads" or "kv" (in columns of the projection),
        "mlp", "expert" or "shared"."""
        return self._range(kind)[0]

    def _range(self, kind: str) -> tuple[range, int]:
        """The rank's rows of a column-parallel layer's output (or columns of a row-parallel
        one's input), and the whole width."""
        s, c, d = self.layout, self.cfg, self.cfg.head_dim
        if kind == "mlp":
            return s.intermediate_range(self.rank), c.intermediate_size
        if kind in ("expert", "shared"):
            width = s.expert if kind == "expert" else s.shared_expert
            assert c.moe is not None
            return range(self.rank * width, (self.rank + 1) * width), width * s.tp
        heads = s.head_range(self.rank) if kind == "heads" else s.kv_head_range(self.rank)
        return range(heads.start * d, heads.stop * d), (c.num_heads if kind == "heads" else c.num_kv_heads) * d
