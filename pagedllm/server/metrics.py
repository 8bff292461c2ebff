"""Prometheus metrics: the engine's counters read at scrape time, plus latency histograms that
the request handlers observe (time to first token, time between tokens)."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..memory.machine import resident_bytes

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ThroughputMeter:
    """Generated tokens per second over the last ``window`` seconds (fed by the engine thread)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def observe(self, outputs, _elapsed: float) -> None:
        now = time.monotonic()
        tokens = sum(1 for o in outputs if o.token_ids)
        with self._lock:
            self._events.append((now, tokens))
            while self._events and self._events[0][0] < now - self.window:
                self._events.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._events if t >= now - self.window]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / self.window


class Metrics:
    def __init__(self, engine, throughput: ThroughputMeter, model_name: str, plan=None):
        """``plan``: the engine's memory plan now (a callable: ``POST /v1/memory`` replaces it)."""
        self.registry = CollectorRegistry()
        self.plan = plan
        self.ttft = Histogram(
            "pagedllm_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pagedllm_inter_token_latency_seconds",
            "Time between consecutive tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_errors: dict[int, int] = {}
        self.registry.register(_EngineCollector(engine, throughput, self, model_name))

    def count_error(self, status: int) -> None:
        self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine, throughput: ThroughputMeter, metrics: Metrics, model_name: str):
        self.engine, self.throughput, self.metrics, self.model = engine, throughput, metrics, model_name

    def collect(self):
        for family, table in ((GaugeMetricFamily, self._gauges()), (CounterMetricFamily, self._counters())):
            for name, (doc, value) in table.items():
                metric = family(name, doc, labels=["model"])
                metric.add_metric([self.model], value)
                yield metric
        errors = CounterMetricFamily("pagedllm_http_errors", "Error responses by status", labels=["status"])
        for status, count in sorted(self.metrics.http_errors.items()):
            errors.add_metric([str(status)], count)
        yield errors

    def _gauges(self) -> dict[str, tuple[str, float]]:
        s = self.engine.stats
        gauges = {
            "pagedllm_requests_running": ("Requests being computed", s.running),
            "pagedllm_requests_waiting": ("Requests queued for admission", s.waiting),
            "pagedllm_kv_blocks_used": ("KV cache blocks in use", s.blocks_used),
            "pagedllm_kv_blocks_total": ("KV cache blocks", s.blocks_total),
            "pagedllm_kv_window_blocks_used": (
                "KV blocks in use in the sliding-window layers' pools (each keeps only its window)",
                s.window_blocks_used,
            ),
            "pagedllm_kv_window_blocks_total": ("KV blocks of the sliding-window layers' pools", s.window_blocks_total),
            "pagedllm_expert_slots": (
                "Routed experts resident at once (0: all of them, none read from the file)",
                s.expert_slots,
            ),
            "pagedllm_streamed_layers": ("Decoder layers read from the model file every step", s.streamed_layers),
            "pagedllm_max_batch_tokens": ("Effective tokens per step", s.max_batch_tokens),
            "pagedllm_kv_blocks_cached_free": ("Unused KV blocks kept for their cached prefix", s.blocks_cached_free),
            "pagedllm_prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / looked up",
                s.prefix_cache_hit_tokens / max(1, s.prefix_cache_queried_tokens),
            ),
            "pagedllm_prefix_disk_bytes": ("The prefix cache's disk tier: bytes of its entries", s.prefix_disk_bytes),
            "pagedllm_prefix_disk_budget_bytes": (
                "The prefix cache's disk tier: its bound (--prefix-cache-disk; 0: no disk tier)",
                s.prefix_disk_budget_bytes,
            ),
            "pagedllm_generation_tokens_per_second": ("Generated tokens per second, last 10 s", self.throughput.rate()),
            "pagedllm_spec_decode_mean_acceptance_length": (
                "Tokens a step carrying speculative guesses gave a request: 1 + accepted / such steps (vLLM's)",
                1 + s.tokens_accepted / max(1, s.speculative_rows),
            ),
        }
        if self.metrics.plan is not None:
            plan = self.metrics.plan()
            gauges["pagedllm_memory_budget_bytes"] = ("The memory budget (memory=)", plan.budget_bytes)
            gauges["pagedllm_memory_planned_bytes"] = ("The plan's peak under load", plan.total_bytes)
        gauges["pagedllm_resident_bytes"] = (
            "Resident memory (VmRSS) of the server's processes, what the budget bounds",
            resident_total(self.engine.pids),
        )
        return gauges

    def _counters(self) -> dict[str, tuple[str, float]]:
        s = self.engine.stats
        return {
            "pagedllm_prompt_tokens": ("Prompt tokens computed", s.prompt_tokens_computed),
            "pagedllm_generation_tokens": ("Tokens generated", s.tokens_generated),
            "pagedllm_preemptions": ("Requests preempted for lack of blocks", s.preemptions),
            "pagedllm_oom_recoveries": ("Steps retried smaller after running out of memory", s.oom_recoveries),
            "pagedllm_requests_finished": ("Requests finished", s.requests_finished),
            "pagedllm_requests_aborted": ("Requests aborted", s.requests_aborted),
            "pagedllm_requests_failed": ("Requests failed inside the engine", s.requests_failed),
            "pagedllm_steps": ("Engine steps", s.steps),
            "pagedllm_spec_decode_num_drafts": ("Decode steps that carried speculative guesses", s.speculative_rows),
            "pagedllm_spec_decode_num_draft_tokens": ("Speculative tokens guessed", s.tokens_drafted),
            "pagedllm_spec_decode_num_accepted_tokens": ("Speculative tokens accepted", s.tokens_accepted),
            "pagedllm_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache",
                s.prefix_cache_hit_tokens,
            ),
            "pagedllm_prefix_cache_evictions": ("Cached blocks evicted for new ones", s.prefix_cache_evictions),
            **{name: (help, getattr(s, field)) for name, (help, field) in DISK_TIER_COUNTERS.items()},
            "pagedllm_state_checkpoints_taken": (
                "States kept at prompt block boundaries for later prefixes (recurrent layers)",
                s.state_checkpoints_taken,
            ),
            "pagedllm_state_checkpoint_hits": (
                "Requests that started from a kept state (its blocks and checkpoint both cached)",
                s.state_checkpoint_hits,
            ),
            "pagedllm_state_checkpoint_evictions": ("Kept states evicted for new ones", s.state_checkpoint_evictions),
            "pagedllm_kv_blocks_copied": (
                "Shared blocks copied on first write (samples of one request)",
                s.blocks_copied,
            ),
            "pagedllm_memory_resizes": (
                "Budgets changed at run time (POST /v1/memory, memory=follow)",
                s.memory_resizes,
            ),
            "pagedllm_idle_releases": ("Idle spells whose free KV cache pages went back to the OS", s.idle_releases),
            "pagedllm_expert_cache_hits": ("Chosen experts found resident in the expert cache", s.expert_hits),
            "pagedllm_expert_cache_misses": ("Chosen experts read from the model file", s.expert_misses),
            "pagedllm_expert_cache_read_bytes": ("Bytes of experts read from the model file", s.expert_bytes_read),
            "pagedllm_layer_stream_read_bytes": (
                "Bytes of layers read from the model file",
                s.streamed_layer_bytes_read,
            ),
        }


# the prefix cache's disk tier (engine.disk_prefix_cache): metric -> (help, EngineStats field)
DISK_TIER_COUNTERS = {
    "pagedllm_prefix_disk_hit_blocks": (
        "KV blocks read back from the prefix cache's disk tier instead of computed",
        "prefix_disk_hit_blocks",
    ),
    "pagedllm_prefix_disk_misses": (
        "Admissions whose prefix went past the KV pool's and found no block on disk",
        "prefix_disk_misses",
    ),
    "pagedllm_prefix_disk_read_bytes": ("Bytes read from the prefix cache's disk tier", "prefix_disk_bytes_read"),
    "pagedllm_prefix_disk_written_bytes": ("Bytes written to the disk tier", "prefix_disk_bytes_written"),
    "pagedllm_prefix_disk_writes_dropped": (
        "Blocks not written to disk: the writer was its buffer behind",
        "prefix_disk_writes_dropped",
    ),
    "pagedllm_prefix_disk_corrupt": (
        "Disk entries that failed their check (deleted; their tokens computed again)",
        "prefix_disk_corrupt",
    ),
    "pagedllm_prefix_disk_evictions": ("Disk entries deleted to stay in --prefix-cache-disk", "prefix_disk_evictions"),
}


def resident_total(pids: list[int]) -> int:
    """VmRSS of ``pids``, summed (a process that has just ended counts nothing)."""
    total = 0
    for pid in pids:
        try:
            total += resident_bytes(pid)[0]
        except (OSError, KeyError):
            pass
    return total
