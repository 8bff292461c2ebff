"""The engine in a process of its own (what `pagedllm serve` runs): what crosses the socket are
deltas, and the API process rebuilds from them exactly the outputs the engine made; a request
there runs as it runs in this process; a plan that cannot fit is the same error here."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine_config import EngineConfig
from pagedllm.engine_process.child import ParentLink
from pagedllm.engine_process.client import EngineProcess, Outputs
from pagedllm.errors import CacheDoesNotFitError


class Box:
    """A sink that keeps everything (the server's Mailbox merges; here every output is checked)."""

    def __init__(self) -> None:
        self.outputs: list = []

    def put(self, out) -> None:
        self.outputs.append(out)


@pytest.mark.slow  # the default model: text, stop strings, multi-byte characters
def test_the_api_process_rebuilds_every_output_the_engine_made(default_llm):
    engine = default_llm.engine
    link, rebuilt = ParentLink(conn=None, engine=None), Outputs()
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Write a short poem about café au lait."}])
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=4, n=3, logprobs=2, stop=["\n\n"])
    rid = engine.add_request(prompt, params)
    rebuilt.prompts[rid] = prompt
    seen = 0
    while engine.has_unfinished():
        for out in engine.step():
            link.put(out)
            (delta,) = link._deltas
            link._deltas.clear()
            assert len(delta.token_ids) <= 1  # a delta carries what is new, not the output so far
            assert rebuilt.rebuild(delta) == out
            seen += 1
    assert seen > 3 * 5 and not rebuilt.prompts  # a finished request leaves nothing behind


def run(process: EngineProcess, prompts: list[list[int]], params: SamplingParams) -> list:
    boxes = [process.add(f"r{i}", p, params, Box()) for i, p in enumerate(prompts)]
    deadline = time.monotonic() + 120
    while process.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.num_unfinished == 0, "the engine process did not answer"
    return [b.outputs[-1] for b in boxes]


def test_a_request_runs_in_the_engine_process_as_it_runs_here(tiny_checkpoints):
    model = str(tiny_checkpoints["qwen3"][0])
    prompts = [[5, 6, 7], [9] * 30, list(range(3, 40))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model, max_model_len=128).generate(prompts, params)]
    process = EngineProcess(EngineConfig.from_options(model, max_model_len=128))
    process.start()
    try:
        finals = run(process, prompts, params)
        assert [o.token_ids for o in finals] == expected
        assert all(o.finished and o.request_finished and o.prompt_token_ids == p for o, p in zip(finals, prompts))
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        box = process.add("long", [5, 6], long, Box())
        while not box.outputs:
            time.sleep(0.01)
        process.abort("long")
        while process.num_unfinished:
            time.sleep(0.01)
        assert box.outputs[-1].finish_reason == "abort" and len(box.outputs[-1].token_ids) < 100
        time.sleep(0.2)  # the next report carries the counters after the abort
        assert process.stats.blocks_used == 0 and process.stats.requests_aborted == 1
    finally:
        process.stop()
    assert process.proc.returncode == 0


def test_a_plan_that_cannot_fit_is_the_planners_error_in_the_api_process(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"][0])
    with pytest.raises(CacheDoesNotFitError, match="budget") as e:
        EngineProcess(EngineConfig.from_options(model, memory="64MiB"))
    assert e.value.breakdown  # the figures cross too, for `pagedllm plan`-style advice


def test_llm_with_its_engine_in_a_process_generates_as_in_this_one(tiny_checkpoints):
    model = str(tiny_checkpoints["mistral"][0])
    prompts = [[5, 6, 7], [11] * 20]
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=6, n=2, seed=3)]
    here = LLM(model, max_model_len=128).generate(prompts, params)
    llm = LLM(model, max_model_len=128, engine_process=True)
    try:
        there = llm.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in there] == [[c.token_ids for c in o.outputs] for o in here]
        assert llm.memory_plan.api_process_bytes > 0 and not llm.engine.has_unfinished()
    finally:
        llm.close()


@pytest.mark.serial  # counts pinned threads: needs the machine's cores
def test_the_engine_process_steps_with_the_one_openmp_team_it_built_with(tiny_checkpoints, monkeypatch):
    """OpenMP gives every thread that starts parallel work a team of its own; a second team
    (stepping on another thread than the one that loaded the model) makes more OpenMP threads
    than cores, and libgomp then stops spinning between parallel regions (served steps at 1.5
    cores busy instead of 2). The engine's pinned workers show the teams: one per extra core."""
    from pagedllm.backends.cpu.threads import allowed_cpus, physical_cores
    from pagedllm.kernels import compiled_ops

    cores = physical_cores(allowed_cpus())
    if len(cores) < 2 or compiled_ops() is None:
        pytest.skip("one core, or no compiled kernels to pin with: no team to count")
    # pinned, and kept so: a busy machine would otherwise make the engine step down and unpin
    monkeypatch.delenv("PAGEDLLM_PIN_THREADS", raising=False)
    monkeypatch.delenv("PAGEDLLM_THREADS", raising=False)
    monkeypatch.setenv("PAGEDLLM_ADAPT_THREADS", "0")
    model = str(tiny_checkpoints["llama"][0])
    process = EngineProcess(EngineConfig.from_options(model, max_model_len=128))
    process.start()
    try:
        run(process, [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
        pid = process.proc.pid
        pinned = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M)
            if allowed and allowed.group(1).isdigit():  # bound to one CPU: an OpenMP worker
                pinned.append(int(allowed.group(1)))
        assert sorted(pinned) == cores[1:]  # the stepping thread is bound to cores[0] only inside a step
    finally:
        process.stop()
