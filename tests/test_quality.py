"""Each lower-precision way to run the default model keeps its rule (tests/formats.py) against
transformers' float32 reading of the same GGUF: perplexity on the shipped text within the
format's bound, logits within its tolerance, and greedy generation judged step by step
(greedy.compare_steps) with the near-tie gap that tolerance gives and a floor of exact steps.
``benchmarks/quality.py`` tables the same on the full 64-prompt workload."""

from __future__ import annotations

import math

import pytest
import torch
from formats import CONFIGS, FLOAT_COPY, FORMAT_RULES, float_copy, hf_model
from greedy import assert_steps_match, reference_step_logits

from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads
from pagedllm.bench.perplexity import perplexity

pytestmark = pytest.mark.slow

TEXT_LOGITS = 512  # the text's first tokens whose logits are compared (two chunks)
FORMATS = ["bf16", "int8", "int4", "w8a8", "gguf-q4_1 bf16, 1 seq", "kv-int8", "kv-fp8"]


@pytest.fixture(scope="module")
def reference():
    """transformers' float32 model, the text's ids, its perplexity on them (the hidden states in
    one pass, the lm_head a chunk at a time) and its logits over the first ``TEXT_LOGITS``."""
    from pagedllm.loading import load_tokenizer
    from pagedllm.loading.default_model import default_gguf_path
    from pagedllm.loading.gguf_cache import converted_dir

    tokenizer = load_tokenizer(converted_dir(default_gguf_path()))
    ids = tokenizer.encode(open("tests/data/quality_text.txt").read(), add_special_tokens=False)
    hf = hf_model()
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
        nll = sum(
            torch.nn.functional.cross_entropy(
                hf.lm_head(hidden[i : i + 256]), torch.tensor(ids[i + 1 : i + 257]), reduction="sum"
            ).item()
            for i in range(0, len(ids) - 1, 256)
        )
        logits = hf.lm_head(hidden[:TEXT_LOGITS]).float()
    prompts = workloads.standard(tokenizer, 8, 32).prompts
    return dict(hf=hf, ids=ids, ppl=math.exp(nll / (len(ids) - 1)), logits=logits, prompts=prompts)


@pytest.mark.parametrize("name", FORMATS)
def test_a_lower_precision_keeps_its_rule_against_float32(reference, name):
    _, model, kwargs = next(c for c in CONFIGS if c[0] == name)
    rule = FORMAT_RULES[name]
    llm = LLM(str(float_copy()) if model == FLOAT_COPY else model, **kwargs)
    ids, ours = reference["ids"], []
    ratio = perplexity(llm, ids, keep_logits=ours) / reference["ppl"]
    error = float((torch.cat(ours)[:TEXT_LOGITS] - reference["logits"]).abs().max())
    error /= float(reference["logits"].abs().max())
    outs = llm.generate(reference["prompts"], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    tokens = [o.token_ids for o in outs]
    logits = [reference_step_logits(reference["hf"], p, t) for p, t in zip(reference["prompts"], tokens)]
    report = assert_steps_match(tokens, logits, rule.precision)
    print(f"{name}: perplexity {ratio:.4f}x float32's, logit error {error:.4f}, {report}")
    assert ratio <= rule.max_perplexity_ratio
    assert error <= rule.precision.logit_tolerance
