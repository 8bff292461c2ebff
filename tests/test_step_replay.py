"""A step is plain data: what the scheduler hands the runner, and what the runner hands the model,
pickles, and a fresh runner given the same weights and the steps in order computes the same
logits. That is what lets a step go to another process or device."""

import dataclasses
import pickle

import torch

from pagedllm import LLM, SamplingParams, loading
from pagedllm.engine import LLMEngine
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.step import ScheduledRow, StepInput
from pagedllm.layers.sampler import Sampler
from pagedllm.sampling_params import StructuredOutput

SIZES = dict(block_size=4, num_blocks=64, max_batch_tokens=24, max_num_seqs=8, max_model_len=96)


def prompt_of(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=g).tolist()


def recording(runner):
    """Wraps ``runner.execute``: every StepInput (pickled) and the logits it produced."""
    steps, real_execute = [], runner.execute

    def execute(step):
        logits = real_execute(step)
        steps.append((pickle.dumps(step), logits.clone()))
        return logits

    runner.execute = execute
    return steps


def test_every_step_pickles_and_replays_into_a_fresh_runner_with_the_same_logits(tiny_checkpoints, kernels):
    d = tiny_checkpoints["llama"][0]
    llm = LLM(d, **SIZES)
    steps = recording(llm.engine.runner)
    shared = prompt_of(30, seed=1)  # 30 tokens over a 24-token budget: chunked prefill
    llm.generate(
        [shared, prompt_of(10, seed=2), prompt_of(13, seed=3)],
        [
            SamplingParams(max_tokens=6, temperature=0),
            SamplingParams(max_tokens=5, temperature=0.8, seed=4, n=3),  # forks: copy-on-write copies
            SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=5),
        ],
    )
    llm.generate([shared + [7, 8]], SamplingParams(max_tokens=3, temperature=0))  # a prefix-cache hit
    assert any(pickle.loads(blob).copies.numel() for blob, _ in steps), "no step copied a block"
    assert any(
        pickle.loads(blob).input_ids.numel() < 32 and pickle.loads(blob).context_lens.max() >= 32
        for blob, _ in steps[-3:]
    ), "the last request did not reuse the cached prefix"

    fresh = loading.load(d, "float32")  # the same weights, loaded again; a cache of zeros
    cfg = fresh.config
    cache = fresh.model.backend.allocate_kv_cache(cfg, SIZES["num_blocks"], SIZES["block_size"], "float32", False)
    runner = ModelRunner(fresh.model, cache, Sampler(()), fresh.model.backend)
    for blob, logits in steps:
        step = pickle.loads(blob)
        for f in dataclasses.fields(StepInput):
            value = getattr(step, f.name)
            assert isinstance(value, int) or (isinstance(value, torch.Tensor) and not value.is_floating_point()), (
                f"StepInput.{f.name} is {type(value).__name__}: only ints and int tensors cross"
            )
        assert torch.equal(runner.execute(step), logits)


def test_a_scheduled_step_holds_no_live_request_state(default_llm):
    """A seeded, constrained request has a torch.Generator and a grammar matcher on the driver;
    neither is in the scheduler's output, which pickles whole."""
    engine = LLMEngine.of(default_llm.loaded, num_blocks=32, max_model_len=256, grammars=default_llm.engine.grammars)
    constraint = StructuredOutput(choice=["yes", "no"])
    rid = engine.add_request(
        "Answer:", SamplingParams(max_tokens=4, temperature=0.9, seed=3, structured_output=constraint)
    )
    seq = engine.requests[rid]
    assert seq.generator is not None and seq.matcher is not None
    out = engine.scheduler.schedule()
    again = pickle.loads(pickle.dumps(out))
    assert again.rows == out.rows and again.copies == out.copies and again.zeros == out.zeros
    for row in out.rows:
        for f in dataclasses.fields(ScheduledRow):
            value = getattr(row, f.name)
            assert isinstance(value, (int, str, bool, list, tuple, SamplingParams)), f"ScheduledRow.{f.name}"
    assert out.rows[0].seq_id == seq.seq_id and out.rows[0].token_ids == seq.prompt_token_ids
    engine.abort(rid)
