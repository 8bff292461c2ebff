"""The engine as a state machine (hypothesis): any interleaving of adds (any length, greedy or
sampled, n samples, shared prefixes), aborts and steps, on caches small enough to force
preemption and eviction, keeps the bookkeeping consistent after every rule, ends every sample
exactly once, and leaves greedy and seeded outputs what they are when the request runs alone."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedllm import SamplingParams, loading
from pagedllm.engine import LLMEngine

PREFIXES = [[], [7] * 5, [8, 9] * 4, [10, 11, 12] * 3]  # shared prefixes exercise the prefix cache
MAX_PROMPT, MAX_NEW = 18, 12


class EngineMachine(RuleBasedStateMachine):
    loaded = None  # set by the test (hypothesis builds the machine itself)
    seen = {"preemptions": 0, "evictions": 0, "copies": 0}  # over every machine of the run
    reference: dict = {}  # (prompt, kind, seed, max_tokens) -> tokens of the request run alone

    @initialize(
        num_blocks=st.sampled_from([10, 16, 40]),
        max_batch_tokens=st.sampled_from([5, 16, 64]),
        prefix_caching=st.booleans(),
    )
    def build(self, num_blocks, max_batch_tokens, prefix_caching):
        self.engine = LLMEngine.of(
            self.loaded,
            block_size=4,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_num_seqs=6,
            max_model_len=40,
            enable_prefix_caching=prefix_caching,
        )
        self.requests: dict[str, tuple] = {}  # id -> (prompt, params)
        self.ended: dict[tuple[str, int], object] = {}  # (id, sample) -> final output
        self.aborted: set[str] = set()

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(3, 200), min_size=1, max_size=10),
        kind=st.sampled_from(["greedy", "seeded", "sampled"]),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, MAX_NEW),
        seed=st.integers(0, 1000),
    )
    def add(self, prefix, tail, kind, n, max_tokens, seed):
        prompt = (PREFIXES[prefix] + tail)[:MAX_PROMPT]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0 if kind == "greedy" else 1.0,
            seed=seed if kind == "seeded" else None,
            n=n,
            ignore_eos=True,
        )
        rid = self.engine.add_request(prompt, params)
        self.requests[rid] = (prompt, params)

    @precondition(lambda self: any(r not in self.aborted for r in self.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r in self.requests if r not in self.aborted)))
        self.aborted.add(rid)
        self._record(self.engine.abort(rid))

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self._record(self.engine.step())

    @invariant()
    def bookkeeping_is_consistent(self):
        if hasattr(self, "engine"):
            self.engine.check_invariants()

    def _record(self, outputs):
        for out in outputs:
            if out.finished:
                key = (out.request_id, out.index)
                assert key not in self.ended, f"sample {key} ended twice"
                self.ended[key] = out

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        while self.engine.has_unfinished():
            self._record(self.engine.step())
            self.engine.check_invariants()
        assert self.engine.blocks.num_free == self.engine.blocks.num_blocks
        stats = self.engine.stats
        for key, value in (
            ("preemptions", stats.preemptions),
            ("evictions", stats.prefix_cache_evictions),
            ("copies", stats.blocks_copied),
        ):
            EngineMachine.seen[key] += value
        for rid, (prompt, params) in self.requests.items():
            samples = sorted(i for r, i in self.ended if r == rid)
            # all n samples, unless aborted before its prompt was computed (then fewer, from 0)
            assert samples == list(range(params.n if rid not in self.aborted else len(samples))) and samples
            for i in samples:
                out = self.ended[rid, i]
                if out.finish_reason == "abort" or params.seed is None and not params.greedy:
                    continue
                assert out.finish_reason == "length", out.error
                assert out.token_ids == self._alone(prompt, params, i), f"{rid}[{i}] differs from running alone"

    def _alone(self, prompt, params, index):
        seed = None if params.seed is None else params.seed + index
        key = (tuple(prompt), params.greedy, seed, params.max_tokens)
        if key not in self.reference:
            solo = LLMEngine.of(self.loaded, block_size=4, num_blocks=40, max_batch_tokens=64, max_model_len=40)
            solo.add_request(
                prompt,
                SamplingParams(
                    max_tokens=params.max_tokens, temperature=params.temperature, seed=seed, ignore_eos=True
                ),
            )
            while solo.has_unfinished():
                for out in solo.step():
                    if out.finished:
                        self.reference[key] = out.token_ids
        return self.reference[key]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])  # gemma3: a window pool beside the full one
def test_any_interleaving_of_adds_aborts_and_steps(tiny_checkpoints, arch):
    EngineMachine.loaded = loading.load(tiny_checkpoints[arch][0])
    EngineMachine.seen = dict.fromkeys(EngineMachine.seen, 0)
    EngineMachine.reference = {}  # (the solo runs of the other model's test)
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # the run exercised what makes interleavings hard, or its green means little
    assert all(EngineMachine.seen.values()), EngineMachine.seen
