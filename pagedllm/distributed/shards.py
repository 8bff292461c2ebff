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
- Norms (and Qwen3's per-head q/k norms) are replicated; so are the biases of the row-parallel
  layers (added once, after the all-reduce).

A tensor-parallel size that does not divide the heads, the KV heads (or is not a multiple of
them) or the MLP width is refused at once, naming the numbers and the sizes that would work.
"""

from __future__ import annotations

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
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"its {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"its {kv} KV heads (tp must divide them, or be a multiple of them)")
    if cfg.intermediate_size % tp:
        problems.append(f"its MLP width of {cfg.intermediate_size}")
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
        vocab=vocab,
        padded_vocab=vocab * tp,
    )


def _divides(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_kv_heads
    kv_ok = kv % tp == 0 if kv >= tp else tp % kv == 0
    return cfg.num_heads % tp == 0 and cfg.intermediate_size % tp == 0 and kv_ok


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one rank runs, as a config: its heads, KV heads, MLP width and vocabulary rows,
    the hidden size whole. Its parameters, KV-cache blocks and step tensors are a rank's (the
    row-parallel outputs are full width: each rank holds the whole sum after the all-reduce)."""
    if tp == 1:
        return cfg
    s = shard_layout(cfg, tp)
    return replace(
        cfg, num_heads=s.heads, num_kv_heads=s.kv_heads, intermediate_size=s.intermediate, vocab_size=s.vocab
    )
