"""Fault injection: one request's failure (NaN/inf in the model, a tokenizer that raises) ends
that request with a clear error; every other request, then and later, is served unchanged."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import RequestRejected

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(engine, prompts, params=GREEDY) -> list:
    """Final outputs, in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def test_nan_in_one_requests_kv_fails_it_alone_and_never_reaches_the_next_owner(tiny_checkpoints):
    d = tiny_checkpoints["llama"][0]
    sizes = dict(block_size=4, num_blocks=40, max_batch_tokens=64, max_model_len=64)
    prompts = [prompt_of(n, seed=n) for n in (9, 10, 11)]
    later = [prompt_of(n, seed=100 + n) for n in (14, 15, 6)]
    reference = LLM(d, **sizes)
    expected = [o.token_ids for o in reference.generate(prompts + later, GREEDY)]

    llm = LLM(d, **sizes)
    engine = llm.engine
    victim = {}

    def poison_once():
        seq = engine.requests.get(victim.get("id"))
        if seq is None or victim.get("done") or not seq.output_token_ids:
            return
        bs = engine.kv_cache.block_size
        for block in engine.blocks.table(seq.seq_id):  # whole blocks: past its end too, like stale K/V
            for cache in (*engine.kv_cache.k, *engine.kv_cache.v):
                cache[:, block * bs : (block + 1) * bs] = float("nan")
        victim["done"] = True

    ids = [engine.add_request(p, GREEDY) for p in prompts]
    victim["id"] = ids[1]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        poison_once()
    failed = done[ids[1]]
    assert failed.finish_reason == "error" and "non-finite" in failed.error
    assert [done[ids[0]].token_ids, done[ids[2]].token_ids] == [expected[0], expected[2]]
    # the freed blocks are handed out again (most recently freed first): still exact
    assert [o.token_ids for o in run_all(engine, later)] == expected[3:]
    assert llm.stats.requests_failed == 1 and engine.blocks.num_used == 0


class FlakyTokenizer:
    """Wraps a tokenizer; ``decode`` raises once a given token id appears in the output."""

    def __init__(self, inner, poison_id: int):
        self.inner, self.poison_id = inner, poison_id

    def decode(self, ids, **kw):
        if self.poison_id in ids:
            raise RuntimeError("injected decode failure")
        return self.inner.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow  # loads the default model
def test_a_tokenizer_that_fails_on_one_output_fails_that_request_only(default_llm):
    engine = default_llm.engine
    prompts = [
        default_llm.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is 2+2?", "Name a colour.", "Say hi.")
    ]
    expected = run_all(engine, prompts)
    # a token the second answer produces and the others do not
    poison = next(t for t in expected[1].token_ids if all(t not in o.token_ids for o in (expected[0], expected[2])))
    real = engine.detokenizer.tokenizer
    engine.detokenizer.tokenizer = FlakyTokenizer(real, poison)
    try:
        got = run_all(engine, prompts)
    finally:
        engine.detokenizer.tokenizer = real
    assert got[1].finish_reason == "error" and "injected decode failure" in got[1].error
    assert [(o.text, o.token_ids) for o in (got[0], got[2])] == [
        (o.text, o.token_ids) for o in (expected[0], expected[2])
    ]
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()


@pytest.mark.slow  # loads the default model
@pytest.mark.parametrize("prompt", ["\ud800", "broken \udfff surrogate"])
def test_text_the_tokenizer_cannot_encode_is_rejected_and_changes_nothing(default_llm, prompt):
    engine = default_llm.engine
    before = dict(vars(engine.stats))
    with pytest.raises(RequestRejected, match="tokenizer cannot encode"):
        default_llm.generate([prompt, "fine"], GREEDY)
    assert dict(vars(engine.stats)) == before and not engine.has_unfinished()
    assert default_llm.generate("fine", GREEDY)[0].finish_reason == "length"


# ---- out of memory inside a step ----------------------------------------------------------------

SEEDED = [SamplingParams(max_tokens=10, temperature=0.9, seed=s, n=2) for s in (3, 4)] + [GREEDY]


def oom_points(engine):
    """Where an allocation can fail inside a step, each as (object, attribute name): attention in
    a middle layer (the Python layer loop's), the compiled decode step's layers, the lm head, the
    sampler after it drew the random numbers, the copy of a block shared by a request's samples."""
    from pagedllm.backends.cpu.attention import CompiledPagedAttention, TorchPagedAttention
    from pagedllm.backends.cpu.decode_program import DecodeProgram
    from pagedllm.layers import sampler

    compiled = engine.backend.name == "cpu-compiled"
    return {
        "attention": (CompiledPagedAttention if compiled else TorchPagedAttention, "attend"),
        "decode_step": (DecodeProgram, "run"),
        "lm_head": (engine.loaded.model.lm_head, "forward"),
        "sampler_after_draws": (sampler, "_logprobs"),
        "copy_on_write": (engine.kv_cache, "copy_blocks"),
    }


@pytest.mark.parametrize("point", ["attention", "decode_step", "lm_head", "sampler_after_draws", "copy_on_write"])
def test_an_out_of_memory_error_anywhere_in_a_step_changes_no_output(tiny_checkpoints, point):
    d = tiny_checkpoints["llama"][0]
    sizes = dict(block_size=4, num_blocks=80, max_batch_tokens=64, max_model_len=64)
    # the samples of a 10- or 15-token prompt share a partly computed block: it is copied
    prompts = [prompt_of(n, seed=n) for n in (10, 15, 6)]
    expected = [[o.token_ids for o in out.outputs] for out in LLM(d, **sizes).generate(prompts, SEEDED)]

    llm = LLM(d, **sizes)
    # these steps are small enough for the compiled decode step, which calls no Python attention
    llm.engine.loaded.model.use_decode_program = point != "attention"
    owner, name = oom_points(llm.engine)[point]
    real = getattr(owner, name)
    calls = {"n": 0}

    def fail_once(*args, **kwargs):
        result = real(*args, **kwargs)  # the work (random draws included) is done, then an allocation fails
        counts = point != "copy_on_write" or bool(args[-1])  # a copy step, not an empty call
        calls["n"] += counts
        if counts and calls["n"] == (1 if point == "copy_on_write" else 4):
            raise torch.OutOfMemoryError(f"injected after {point}")
        return result

    setattr(owner, name, fail_once)
    try:
        got = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, SEEDED)]
    finally:
        setattr(owner, name, real)
    assert llm.stats.oom_recoveries == 1, "the injected error must have happened inside a step"
    assert got == expected
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
