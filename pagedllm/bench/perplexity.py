"""Perplexity as the engine computes it: a text fed through the model chunk by chunk as one
sequence whose K/V stay in the paged cache, each token predicted from all the text before it.
What ``benchmarks/quality.py`` tables per format and the quality tests bound."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..backends.cpu.attention import SequenceSlice, StepLayout
from ..engine import LLMEngine

if TYPE_CHECKING:
    from ..llm import LLM

CHUNK = 256  # tokens per forward pass


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], chunk: int = CHUNK, keep_logits: list | None = None) -> float:
    """exp(mean NLL of ids[1:]), each token predicted from every token before it; each chunk's
    logits appended to ``keep_logits`` if given.

    One sequence, fed ``chunk`` tokens per step the way the engine's runner feeds a prompt: the
    block manager gives it blocks (under an id no request has), the step's layout says where its
    K/V go, and the model returns logits for every row of the chunk."""
    engine = llm.engine
    if not isinstance(engine, LLMEngine):
        raise TypeError("perplexity reads the model in this process: LLM(..., engine_process=False)")
    model, blocks = engine.runner.model, engine.blocks
    cfg = model.config
    seq_id = -1  # requests' ids count up from 0
    nll, count = 0.0, 0
    try:
        with engine.threads.running():
            for start in range(0, len(ids) - 1, chunk):
                end = min(start + chunk, len(ids) - 1)  # the last token is only ever a target
                engine.kv_cache.copy_blocks(blocks.prepare_write(seq_id, start, end))  # no copies: not forked
                layout = StepLayout.from_slices(
                    [SequenceSlice(0, end - start, end, blocks.tables_of(seq_id))],
                    engine.kv_cache.block_size,
                    cfg.num_heads // cfg.num_kv_heads,
                )
                logits = model(
                    torch.tensor(ids[start:end]),
                    torch.arange(start, end),
                    engine.backend.attention(engine.kv_cache, layout),
                    torch.arange(end - start),
                )
                if keep_logits is not None:
                    keep_logits.append(logits.float())
                targets = torch.tensor(ids[start + 1 : end + 1])
                nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                count += end - start
                blocks.drop_out_of_window(seq_id, end)
    finally:
        blocks.free(seq_id)
    return math.exp(nll / count)
