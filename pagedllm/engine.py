"""LLMEngine: the step loop. add_request / abort / step, driven by LLM or by the server.

One step: the scheduler picks tokens under the budget, the runner computes logits for the rows
that sample, the sampler picks tokens, and each sequence is checked for its stop conditions; a
finished or aborted sequence's blocks are freed at once, so a waiting one can use them next step.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .detokenizer import Detokenizer
from .kv_cache import KVCache
from .planner import MemoryPlan, StepShape, plan_engine
from .loading import LoadedModel
from .model_runner import ModelRunner
from .outputs import RequestMetrics, RequestOutput
from .sampler import CHUNK_ROWS, Sampler, needs_full_path
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status

log = logging.getLogger(__name__)


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
    blocks_cached_free: int = 0  # unused blocks kept for their cached prefix (counted as free)
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from cached blocks, not recomputed
    prefix_cache_evictions: int = 0
    blocks_copied: int = 0  # copy-on-write copies of blocks shared by the samples of one request
    oom_recoveries: int = 0
    max_batch_tokens: int = 0  # the effective step budget (lowered by out-of-memory recoveries)


class LLMEngine:
    """Give it a loaded model and either a ``plan`` (from ``planner.plan_engine``) or the same
    knobs ``plan_engine`` takes; the plan is checked before the KV cache is allocated."""

    def __init__(self, loaded: LoadedModel, *, plan: MemoryPlan | None = None,
                 enable_prefix_caching: bool = True, **sizes):
        cfg = loaded.config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if plan is None:
            weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
            plan = plan_engine(cfg, model_name=loaded.name, dtype=_dtype_name(loaded), already_loaded=weights,
                               **sizes)
        self.memory_plan = plan
        self.max_model_len = plan.max_model_len
        self.blocks = BlockManager(plan.num_blocks, plan.block_size, enable_prefix_caching)
        self.kv_cache = KVCache(cfg, plan.num_blocks, plan.block_size, getattr(torch, plan.kv_dtype))
        self.scheduler = Scheduler(self.blocks, plan.max_batch_tokens, plan.max_num_seqs)
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.blocks)
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.sampler = Sampler(self.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.last_step_shape: StepShape | None = None
        # Debug mode (the test suite runs with it): verify every step's bookkeeping.
        self.check_invariants_every_step = os.environ.get("PAGEDLLM_CHECK_INVARIANTS", "") not in ("", "0")
        self.stats = EngineStats(blocks_total=plan.num_blocks, blocks_free=plan.num_blocks,
                                 max_batch_tokens=plan.max_batch_tokens)
        self._ids = itertools.count()
        log.info("memory plan:\n%s", plan.table())

    # ---- requests -------------------------------------------------------------------------

    @property
    def cache_capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def encode(self, prompt: str) -> list[int]:
        """Text to token ids; a prompt the tokenizer fails on is rejected, like any bad input."""
        if self.tokenizer is None:
            raise RequestRejected("this model directory has no tokenizer: pass token ids instead of text")
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        except Exception as e:
            raise RequestRejected(f"the tokenizer cannot encode this prompt: {type(e).__name__}: {e}") from None

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request; raises RequestRejected (and changes nothing) if it can never run."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.validate(request_id, ids, params)
        seq = Sequence(request_id, ids, params)  # n > 1: forks into n samples later (see sequence.py)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self._refresh_gauges()
        return request_id

    def validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if not ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        if params.n > self.scheduler.max_num_seqs:
            raise RequestRejected(f"n={params.n} samples exceed max_num_seqs={self.scheduler.max_num_seqs}")
        need = len(ids) + params.max_tokens
        if need > min(self.max_model_len, self.cache_capacity_tokens):
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} tokens exceeds "
                f"max_model_len={self.max_model_len} (the KV cache holds {self.cache_capacity_tokens} "
                f"tokens: {self.blocks.num_blocks} blocks of {self.blocks.block_size})"
            )

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Ends every unfinished sample of a request; returns their final outputs ([] if the
        request is unknown or already finished)."""
        first = self.requests.get(request_id)
        if first is None:
            return []
        live = [s for s in first.group if not s.is_finished]
        for seq in live:
            self._finish(seq, "abort")
        self.stats.requests_aborted += 1
        self._refresh_gauges()
        return [self._output(seq) for seq in live]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that produced text or finished.

        All computation happens before any request's state changes, so a step that runs out of
        memory is simply retried smaller (see ``_recover_from_oom``) and loses nothing.
        """
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        self.stats.blocks_copied += len(batch.copies)
        if not batch:
            self._refresh_stats(0)
            return []
        # Copy-on-write before anything computes (a source block may be rewritten by its new
        # owner in this very step), and outside the retry: the tables already point at the copies.
        self.kv_cache.copy_blocks(batch.copies)
        try:
            logits, sampled = self.runner.run(batch)
            seqs = [batch.seqs[i] for i in sampled]
            self.last_step_shape = self._shape(batch, seqs)
            # a row is finite iff its max and min are (NaN propagates): no [S, vocab] temporaries
            finite = (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()
            good = [s for s, ok in zip(seqs, finite) if ok]
            bad = [s for s, ok in zip(seqs, finite) if not ok]
            if bad:
                logits = logits[[i for i, ok in enumerate(finite) if ok]]
            result = self.sampler(logits, good) if good else None
            del logits
        except (torch.OutOfMemoryError, MemoryError) as e:
            self._recover_from_oom(batch, e)
            return []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            prompt_part = max(0, min(seq.num_prompt_tokens, seq.num_computed_tokens + n) - seq.num_computed_tokens)
            self.stats.prompt_tokens_computed += prompt_part
            seq.num_computed_tokens += n
            self.blocks.register_computed(seq.seq_id, seq.tokens, seq.num_computed_tokens)
        outputs = []
        for seq in bad:
            self.kv_cache.zero_blocks(self.blocks.release_poisoned(seq.seq_id))
            self._finish(seq, "error", "the model produced non-finite logits (NaN/inf) for this request")
            self.stats.requests_failed += 1
            outputs.append(self._output(seq))
        if result is not None:
            now = time.perf_counter()
            for seq, token, lp in zip(good, result.token_ids, result.logprobs):
                outputs.append(self._append_token(seq, token, lp, now))
        self.stats.steps += 1
        self._refresh_stats(batch.total_tokens)
        if self.check_invariants_every_step:
            self.check_invariants()
        return outputs

    def check_invariants(self) -> None:
        """Raises AssertionError if the block manager and the queues disagree: a block both free
        and owned, a leak, a request in two states or in none, a finished request still queued."""
        self.blocks.check_invariants()
        running = {s.seq_id for s in self.scheduler.running}
        waiting = {s.seq_id for s in self.scheduler.waiting}
        known = {s.seq_id for first in self.requests.values() for s in first.group if not s.is_finished}
        problems = []
        if len(running) != len(self.scheduler.running) or len(waiting) != len(self.scheduler.waiting):
            problems.append("a request is queued twice")
        if running & waiting:
            problems.append(f"requests both running and waiting: {sorted(running & waiting)}")
        if running | waiting != known:
            problems.append(f"queued sequences {sorted(running | waiting)} but live ones {sorted(known)}")
        if self.scheduler.slots_used > self.scheduler.max_num_seqs:
            problems.append(f"{self.scheduler.slots_used} running samples exceed max_num_seqs")
        if set(self.blocks.tables) - running:
            problems.append(f"blocks held by requests not running: {sorted(set(self.blocks.tables) - running)}")
        for seq in self.scheduler.running:
            if seq.status is not Status.RUNNING:
                problems.append(f"{seq.request_id}[{seq.index}] is in the running queue with status {seq.status}")
            need = self.blocks.blocks_for(seq.num_computed_tokens)
            if len(self.blocks.table(seq.seq_id)) < need:
                problems.append(f"{seq.request_id}[{seq.index}] computed {seq.num_computed_tokens} tokens but "
                                f"holds {len(self.blocks.table(seq.seq_id))} blocks")
        for seq in self.scheduler.waiting:
            if seq.status is not Status.WAITING or seq.num_computed_tokens:
                problems.append(f"{seq.request_id}[{seq.index}] waits with status {seq.status} and "
                                f"{seq.num_computed_tokens} computed tokens")
        if problems:
            raise AssertionError("engine invariants broken: " + "; ".join(problems))

    def _recover_from_oom(self, batch, error: BaseException) -> None:
        """Halves the step budget so the same work is retried as smaller steps next time.

        Nothing was committed: sequences keep their state and blocks, and the next schedule
        splits their tokens under the lower budget. A one-token step that still fails re-raises.
        """
        if batch.total_tokens <= 1:
            raise error
        old = self.scheduler.max_batch_tokens
        self.scheduler.max_batch_tokens = max(1, min(old, batch.total_tokens // 2))
        self.stats.oom_recoveries += 1
        self.stats.max_batch_tokens = self.scheduler.max_batch_tokens
        log.warning("out of memory in a step of %d tokens (%s); max_batch_tokens %d -> %d",
                    batch.total_tokens, type(error).__name__, old, self.scheduler.max_batch_tokens)

    def _shape(self, batch, sampled: list[Sequence]) -> StepShape:
        """This step as the memory planner sees it (checked against measured peaks in tests)."""
        layout = self.runner.last_layout
        full, penalized = [], []
        for c0 in range(0, len(sampled), CHUNK_ROWS):
            chunk = sampled[c0:c0 + CHUNK_ROWS]
            if any(needs_full_path(s) for s in chunk):
                full.append(len(chunk))
            penalized += [s.num_tokens for s in chunk if s.params.repetition_penalty != 1
                          or s.params.presence_penalty or s.params.frequency_penalty]
        return StepShape(
            tokens=batch.total_tokens, sampled=len(sampled),
            decode_groups=[(g.blocks.shape[0], g.keys, True) for g in layout.decode_groups],
            prefills=[(p.length, p.context_len) for p in layout.prefills],
            full_sampler_rows=full, penalized_lengths=penalized)

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
        try:
            stopped_by_string = self.detokenizer.update(seq, drop_last=stopped_by_token)
        except Exception as e:  # this request's text is lost; nobody else's is
            log.warning("detokenizing %s failed: %r", seq.request_id, e)
            self._finish(seq, "error", f"the tokenizer cannot decode this output: {type(e).__name__}: {e}")
            self.stats.requests_failed += 1
            return self._output(seq)
        if stopped_by_token or stopped_by_string:
            self._finish(seq, "stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
        if seq.is_finished and seq.request_finished:
            self.stats.requests_finished += 1
        return self._output(seq)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.is_finished:
            return
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.pending_forks = 0  # a request aborted before it forked has no other samples
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter()
        if seq.request_finished:
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
            index=seq.index,
            request_finished=seq.request_finished,
        )

    def _refresh_stats(self, step_tokens: int) -> None:
        self.stats.last_step_tokens = step_tokens
        self.stats.tokens_computed += step_tokens
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        """Queue lengths and block counts, kept current after every step, add and abort."""
        s, prefix = self.stats, self.blocks.prefix_stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.blocks_used = self.blocks.num_used
        s.blocks_free = self.blocks.num_free
        s.blocks_cached_free = self.blocks.num_cached_free
        s.prefix_cache_queried_tokens = prefix.queried_tokens
        s.prefix_cache_hit_tokens = prefix.hit_tokens
        s.prefix_cache_evictions = prefix.evictions


def _dtype_name(loaded: LoadedModel) -> str:
    return str(next(loaded.model.parameters()).dtype).replace("torch.", "")
