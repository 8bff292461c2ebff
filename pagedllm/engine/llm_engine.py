"""LLMEngine: the step loop. add_request / abort / step, driven by LLM or by the server.

One step: the scheduler picks tokens under the budget, the runner computes and samples them, the
scheduler commits the result (and ends the sequences that are done, freeing their blocks at once,
so a waiting request can use them next step); the engine turns what changed into outputs.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import asdict, dataclass

import torch

from .. import env, prompts
from ..backends.base import KVCache
from ..engine_config import ConfigError, EngineConfig
from ..errors import CacheDoesNotFitError, RequestRejected
from ..limits import RequestLimits
from ..loading import LoadedModel
from ..memory.footprint import StepShape
from ..memory.planner import MemoryPlan
from ..outputs import RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams, StructuredOutput
from ..sizes import dtype_name
from ..structured import Grammars
from .block_pools import BlockPools
from .parts import EngineParts, assemble
from .ranks import Ranks
from .scheduler import SchedulerCounters
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class EngineStats(SchedulerCounters):
    """A snapshot, replaced (never mutated) after every step, add and abort, so another thread
    (the server's metrics) always reads one consistent set of figures."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    blocks_cached_free: int = 0  # unused blocks kept for their cached prefix (counted as free)
    # the sliding-window layers' pools together (``block_pools``; 0 where every layer is alike)
    window_blocks_used: int = 0
    window_blocks_total: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from cached blocks, not recomputed
    prefix_cache_evictions: int = 0
    # a model with states per sequence: its prefix checkpoints (``engine.state_checkpoints``)
    state_checkpoints_taken: int = 0
    state_checkpoint_hits: int = 0  # requests that started from one (their hit tokens are prefix_cache_hit_tokens)
    state_checkpoint_evictions: int = 0
    # the prefix cache's disk tier (``engine.disk_prefix_cache``; 0 without --prefix-cache-dir)
    prefix_disk_budget_bytes: int = 0
    prefix_disk_bytes: int = 0  # its directory's entries, at the last count
    prefix_disk_hit_blocks: int = 0  # blocks read back instead of computed
    prefix_disk_misses: int = 0  # admissions whose chain went past the pool and found nothing on disk
    prefix_disk_bytes_read: int = 0
    prefix_disk_bytes_written: int = 0
    prefix_disk_writes_dropped: int = 0
    prefix_disk_corrupt: int = 0  # entries that failed their check (deleted, recomputed)
    prefix_disk_evictions: int = 0
    last_step_tokens: int = 0
    max_batch_tokens: int = 0  # the effective step budget (lowered by out-of-memory recoveries)
    memory_resizes: int = 0  # budgets changed at run time (set_memory, memory="follow")
    idle_releases: int = 0  # idle spells whose free cache pages went back to the OS
    # a mixture whose routed experts are read from the file (layers/expert_cache.py; 0 otherwise)
    expert_slots: int = 0
    expert_hits: int = 0  # chosen experts found resident
    expert_misses: int = 0  # chosen experts read from the file
    expert_bytes_read: int = 0
    # a dense model whose last layers are read from the file every step (layers/layer_stream.py)
    streamed_layers: int = 0
    streamed_layer_reads: int = 0
    streamed_layer_bytes_read: int = 0


class LLMEngine:
    """The step loop over parts made for it (``parts.assemble``): ``build_engine`` plans, loads
    and assembles them; ``LLMEngine.of`` assembles them for a model loaded already. It builds
    nothing itself.

    The backend is the model's (``loaded.model.backend``): the cache, the attention and the
    threads are the same device's."""

    def __init__(self, parts: EngineParts, loaded: LoadedModel, grammars: Grammars | None, ranks: Ranks | None):
        """``grammars``: the structured-output compiler for this tokenizer (``LLM`` builds it
        before measuring the process); without one, the first constrained request builds it.
        ``ranks``: the other ranks of a split model (``build_engine`` starts them); this engine is
        their driver, and ``loaded`` its shard."""
        config = parts.memory.config
        self.loaded, self.backend, self.tokenizer, self.ranks = loaded, parts.backend, loaded.tokenizer, ranks
        self.memory, self.elastic, self.threads = parts.memory, parts.elastic, parts.threads
        self.scheduler, self.runner, self.sampler = parts.scheduler, parts.runner, parts.sampler
        self.detokenizer, self.drafter, self.eos_token_ids = parts.detokenizer, parts.drafter, parts.eos_token_ids
        self.max_model_len = parts.memory.plan.max_model_len
        self._grammars = grammars
        self.structured_output = config.structured_output
        self._grammars_lock = threading.Lock()
        # Debug mode (the test suite runs with it): verify every step's bookkeeping.
        self.check_invariants_every_step = env.CHECK_INVARIANTS.get()
        self.record_step_shapes = False  # the memory tests turn it on to read last_step_shape
        self.last_step_shape: StepShape | None = None
        self._ids = itertools.count()
        self._refresh_stats(0)
        log.info("memory plan:\n%s", self.memory_plan.table())

    @classmethod
    def of(
        cls,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        plan: MemoryPlan | None = None,
        grammars: Grammars | None = None,
        ranks: Ranks | None = None,
        draft: LoadedModel | None = None,
        **options,
    ) -> LLMEngine:
        """The engine for a model loaded already, under an ``EngineConfig`` (or its fields as
        keyword arguments) and optionally the ``plan`` made for them; without one it plans now,
        from what the process holds, before the KV cache is allocated (with a budget, the whole
        cache is committed now). ``draft``: speculative decoding's draft model
        (``speculative_method='draft_model'``), loaded now from ``config.draft_model`` if not given."""
        model_dtype = dtype_name(next(loaded.model.parameters()).dtype)
        config = config or EngineConfig.from_options(**{"dtype": model_dtype, **options})
        if config.dtype != model_dtype:
            raise ConfigError("dtype", f"{config.dtype} asked for, but the loaded model is {model_dtype}")
        return cls(assemble(loaded, config, plan, grammars, ranks, draft), loaded, grammars, ranks)

    # ---- what the engine's memory is made of: EngineMemory's, read here ------------------------

    @property
    def config(self) -> EngineConfig:
        return self.memory.config

    @property
    def memory_plan(self) -> MemoryPlan:
        return self.memory.plan

    @property
    def limits(self) -> RequestLimits:
        return self.memory.limits

    @property
    def kv_cache(self) -> KVCache:
        return self.memory.kv_cache

    @property
    def blocks(self) -> BlockPools:
        return self.memory.blocks

    # ---- requests -------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Sequence]:
        """Unfinished requests by id (their first sample); read-only for callers."""
        return self.scheduler.requests

    @property
    def cache_capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def encode(self, prompt: str) -> list[int]:
        """Text to token ids; a prompt the tokenizer fails on is rejected, like any bad input."""
        return prompts.encode_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
    ) -> str:
        """Queues a request; raises RequestRejected (and changes nothing) if it can never run.
        ``arrival_time`` (time.perf_counter seconds, default now) is when the request really
        arrived, for a caller that queued it first (the server): its latency metrics count from it."""
        # unset sampling fields: the model's defaults, else pagedllm's (SamplingParams.with_defaults)
        params = (params or SamplingParams()).with_defaults(self.loaded.sampling_defaults)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", param=None)
        self.validate(ids, params)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        constraint = params.structured_output
        matcher = self.grammars.matcher(constraint) if constraint is not None else None
        self.scheduler.add(
            Sequence(request_id, ids, params, arrival_time=arrival, matcher=matcher)
        )  # n > 1: forks later
        self._refresh_stats(0)
        return request_id

    def validate(self, ids: list[int], params: SamplingParams, compile_grammar: bool = True) -> None:
        """Raises RequestRejected, naming the field to blame, for a request that can never run.
        Reads only limits fixed at start, so any thread may call it. ``compile_grammar=False``
        leaves a structured output's grammar to ``add_request`` (it compiles it then)."""
        self.limits.check(ids, params)
        if params.structured_output is not None:
            self.validate_constraint(params.structured_output, compile_grammar)

    def validate_constraint(self, constraint: StructuredOutput, compile_grammar: bool = True) -> None:
        """RequestRejected, naming the constraint's field, if structured output cannot be served
        here or (``compile_grammar``) the grammar does not compile; compiled grammars are cached."""
        try:
            grammars = self.grammars
        except RequestRejected as e:  # no xgrammar, no tokenizer, or turned off
            raise RequestRejected(e.message, param=constraint.param) from None
        if compile_grammar:
            grammars.compile(constraint)  # cached: add_request reuses it

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler; built on first use when the engine was given none
        (RequestRejected if xgrammar is not installed)."""
        with self._grammars_lock:
            if self._grammars is None:
                if not self.structured_output:
                    raise RequestRejected(
                        "structured output is off in this engine (structured_output=False)",
                        param="structured_output",
                    )
                if self.tokenizer is None:
                    raise RequestRejected("structured output needs the model's tokenizer", param="structured_output")
                self._grammars = Grammars(self.tokenizer, self.loaded.config.vocab_size, self.eos_token_ids)
                self.sampler.grammars = self._grammars
            return self._grammars

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Ends every unfinished sample of a request; returns their final outputs ([] if the
        request is unknown or already finished)."""
        outputs = self._outputs(self.scheduler.abort(request_id))
        self._refresh_stats(0)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the budget at run time (engine/elastic.py) -------------------------------------------

    def set_memory(self, memory: str | int | None = None, memory_fraction: float | None = None) -> MemoryPlan:
        """Moves the engine to a new budget, keeping its requests (``ElasticMemory.set_memory``).
        Call it on the thread that steps."""
        plan = self.elastic.set_memory(memory, memory_fraction)
        self._refresh_stats(0)
        return plan

    def follow_machine(self) -> None:
        self.elastic.follow_machine()
        self._refresh_stats(0)

    def while_idle(self) -> None:
        """For a serving loop with nothing to step: ``memory="follow"`` and idle release."""
        self.elastic.while_idle()
        self._refresh_stats(0)

    def release_idle_memory(self, keep_prefix_cache: bool = False) -> int:
        """With nothing running, the free blocks' pages back to the OS (``ElasticMemory.release_idle``)."""
        released = self.elastic.release_idle(keep_prefix_cache)
        self._refresh_stats(0)
        return released

    def close(self) -> None:
        """Writes the disk tier's queued blocks; ends the other ranks of a split model."""
        if self.blocks.disk is not None:
            self.blocks.disk.close()
        if self.ranks is not None:
            self.ranks.close()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every sample that produced text or finished.
        A step that runs out of memory commits nothing and is retried smaller next time."""
        self.elastic.settle()  # a grown budget that has held opens to new admissions
        if self.drafter is None:
            out = self.scheduler.schedule()
        else:  # the draft model guesses while the step is scheduled
            with self.threads.running():
                out = self.scheduler.schedule()
        outputs = []
        if out:
            seqs = self.scheduler.sequences(out)
            # A seeded sample's draws must not depend on a failed try: its generator is rewound.
            seeded = [(s.generator, s.generator.get_state()) for s in seqs if s.generator]
            try:
                with self.threads.running():
                    result = self.runner.run(out, seqs)
            except CacheDoesNotFitError:
                raise  # a planning error, never a step's: nothing to retry smaller
            except (torch.OutOfMemoryError, MemoryError) as e:
                for generator, state in seeded:
                    generator.set_state(state)
                self.scheduler.recover_from_oom(out, e)
            else:
                if self.record_step_shapes:
                    self.last_step_shape = self.runner.step_shape(out, seqs)
                outputs = self._outputs(self.scheduler.update_from_output(out, result))
        self.threads.after_step()
        self.elastic.stepped(bool(out))  # (may move to a new budget: memory="follow")
        self._refresh_stats(out.total_tokens)
        if self.check_invariants_every_step:
            self.check_invariants()
        return outputs

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """One output per sample; when several samples of a request end together, only the last
        of them says ``request_finished`` (readers stop at it)."""
        outputs = [self._output(seq) for seq in seqs]
        seen: set[str] = set()
        for out in reversed(outputs):
            if out.request_finished:
                out.request_finished = out.request_id not in seen
                seen.add(out.request_id)
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        end = self.detokenizer.releasable(seq)
        delta = seq.text[seq.emitted_chars : end]
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
            error_kind=seq.error_kind,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            embedding=seq.embedding,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions),
            index=seq.index,
            request_finished=seq.request_finished,
        )

    def _refresh_stats(self, step_tokens: int) -> None:
        """Queue lengths, block counts and counters, as one new snapshot."""
        s, blocks, prefix = self.scheduler, self.blocks, self.blocks.prefix_stats
        self.stats = EngineStats(
            **asdict(s.counters),
            running=len(s.running),
            waiting=len(s.waiting),
            blocks_used=blocks.num_used,
            blocks_free=blocks.num_free,
            blocks_total=blocks.num_blocks,
            blocks_cached_free=blocks.num_cached_free,
            window_blocks_used=sum(p.num_used for p in blocks.pools[1:]),
            window_blocks_total=sum(p.num_blocks for p in blocks.pools[1:]),
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            prefix_cache_evictions=prefix.evictions,
            **self._checkpoint_stats(),
            **self._disk_tier_stats(),
            last_step_tokens=step_tokens,
            max_batch_tokens=s.max_batch_tokens,
            memory_resizes=self.elastic.resizes,
            idle_releases=self.elastic.idle_releases,
            **self._expert_stats(),
            **self._layer_stream_stats(),
        )

    def _checkpoint_stats(self) -> dict:
        checkpoints = self.blocks.checkpoints
        if checkpoints is None:
            return {}
        c = checkpoints.stats
        return dict(state_checkpoints_taken=c.taken, state_checkpoint_hits=c.hits, state_checkpoint_evictions=c.evicted)

    def _disk_tier_stats(self) -> dict:
        disk = self.blocks.disk
        if disk is None:
            return {}
        d = disk.stats
        return {
            "prefix_disk_budget_bytes": disk.budget,
            "prefix_disk_bytes": d.disk_bytes,
            "prefix_disk_hit_blocks": d.hit_blocks,
            "prefix_disk_misses": d.misses,
            "prefix_disk_bytes_read": d.bytes_read,
            "prefix_disk_bytes_written": d.bytes_written,
            "prefix_disk_writes_dropped": d.writes_dropped,
            "prefix_disk_corrupt": d.corrupt,
            "prefix_disk_evictions": d.evicted,
        }

    def _layer_stream_stats(self) -> dict:
        stream = self.loaded.model.layer_stream
        if stream is None:
            return {}
        return {
            "streamed_layers": len(stream.order),
            "streamed_layer_reads": stream.stats.reads,
            "streamed_layer_bytes_read": stream.stats.bytes_read,
        }

    def _expert_stats(self) -> dict:
        cache = self.loaded.model.expert_cache
        if cache is None:
            return {}
        stats = cache.stats
        return {
            "expert_slots": sum(p.slots for p in cache.pools),
            "expert_hits": stats.hits,
            "expert_misses": stats.misses,
            "expert_bytes_read": stats.bytes_read,
        }
