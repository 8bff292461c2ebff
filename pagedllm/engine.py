"""LLMEngine: the step loop. add_request / abort / step, driven by LLM or by the server.

One step: the scheduler picks tokens under the budget, the runner computes logits for the rows
that sample, the sampler picks tokens, and each sequence is checked for its stop conditions; a
finished or aborted sequence's blocks are freed at once, so a waiting one can use them next step.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .detokenizer import Detokenizer
from .kv_cache import KVCache, kv_bytes_per_block
from .loading import LoadedModel
from .model_runner import ModelRunner
from .outputs import RequestMetrics, RequestOutput
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status

log = logging.getLogger(__name__)

# Used until the memory planner sizes the cache: room for the KV of this many bytes.
DEFAULT_KV_CACHE_BYTES = 512 * 1024**2
DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_MAX_NUM_SEQS = 64


class RequestRejected(ValueError):
    """A request that can never be served as given (too long, bad token ids, bad parameters)."""


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    prompt_tokens_computed: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    last_step_tokens: int = 0
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_total: int = 0


class LLMEngine:
    def __init__(self, loaded: LoadedModel, *, block_size: int = 16, num_blocks: int | None = None,
                 max_batch_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, kv_cache_dtype: torch.dtype | None = None):
        cfg = loaded.config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        kv_dtype = kv_cache_dtype or next(loaded.model.parameters()).dtype
        if num_blocks is None:
            num_blocks = max(1, DEFAULT_KV_CACHE_BYTES // kv_bytes_per_block(cfg, block_size, kv_dtype))
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv_cache = KVCache(cfg, num_blocks, block_size, kv_dtype)
        self.scheduler = Scheduler(self.blocks, max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS,
                                   max_num_seqs or DEFAULT_MAX_NUM_SEQS)
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.blocks)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.sampler = Sampler(self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats(blocks_total=num_blocks, blocks_free=num_blocks)
        self._ids = itertools.count()
        log.info("engine: %d blocks x %d tokens (%.2f GiB KV cache), max_batch_tokens=%d, max_num_seqs=%d",
                 num_blocks, block_size, self.kv_cache.nbytes / 1024**3,
                 self.scheduler.max_batch_tokens, self.scheduler.max_num_seqs)

    # ---- requests -------------------------------------------------------------------------

    @property
    def cache_capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestRejected("this model directory has no tokenizer: pass token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request; raises RequestRejected (and changes nothing) if it can never run."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.validate(request_id, ids, params)
        seq = Sequence(request_id, ids, params)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        need = len(ids) + params.max_tokens
        if need > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds "
                f"the model's maximum length of {self.max_model_len} tokens"
            )
        if need > self.cache_capacity_tokens:
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} can never "
                f"fit in the KV cache, which holds {self.cache_capacity_tokens} tokens "
                f"({self.blocks.num_blocks} blocks of {self.blocks.block_size})"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        self.stats.requests_aborted += 1
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that produced text or finished."""
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        if not batch:
            self._refresh_stats(0)
            return []
        logits, sampled = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            prompt_part = max(0, min(seq.num_prompt_tokens, seq.num_computed_tokens + n) - seq.num_computed_tokens)
            self.stats.prompt_tokens_computed += prompt_part
            seq.num_computed_tokens += n
        seqs = [batch.seqs[i] for i in sampled]
        outputs = []
        if seqs:
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            bad = [s for s, ok in zip(seqs, finite) if not ok]
            for seq in bad:
                self._finish(seq, "error", "the model produced non-finite logits for this request")
                self.stats.requests_failed += 1
                outputs.append(self._output(seq))
            if bad:
                keep = [i for i, ok in enumerate(finite) if ok]
                logits, seqs = logits[keep], [seqs[i] for i in keep]
        if seqs:
            result = self.sampler(logits, seqs)
            now = time.perf_counter()
            for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
                outputs.append(self._append_token(seq, token, lp, now))
        self.stats.steps += 1
        self._refresh_stats(batch.total_tokens)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: dict | None, now: float) -> RequestOutput:
        params = seq.params
        seq.output_token_ids.append(token)
        self.stats.tokens_generated += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
        stopped_by_token = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids)
        stopped_by_string = self.detokenizer.update(seq, drop_last=stopped_by_token)
        if stopped_by_token or stopped_by_string:
            self._finish(seq, "stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
        if seq.is_finished:
            self.stats.requests_finished += 1
        return self._output(seq)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.is_finished:
            return
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter()
        del self.requests[seq.request_id]

    def _output(self, seq: Sequence) -> RequestOutput:
        end = self.detokenizer.releasable(seq)
        delta = seq.text[seq.emitted_chars:end]
        seq.emitted_chars = end
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text[:end],
            token_ids=list(seq.output_token_ids),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            delta_text=delta,
            error=seq.error,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time,
                                   seq.num_preemptions),
        )

    def _refresh_stats(self, step_tokens: int) -> None:
        s = self.stats
        s.last_step_tokens = step_tokens
        s.tokens_computed += step_tokens
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.blocks_used = self.blocks.num_used
        s.blocks_free = self.blocks.num_free
