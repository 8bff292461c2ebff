"""Structured output with the default model: every constrained output parses and validates,
greedy and sampled; a grammar changes nothing for the rows without one; and it holds through
n > 1, seeds, stop strings, logprobs, penalties, chunked prefill, prefix caching and preemption."""

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, backends
from pagedllm.bench.schemas import SCHEMAS
from pagedllm.errors import RequestRejected
from pagedllm.sampling_params import StructuredOutput

pytestmark = pytest.mark.slow

SEEDS = range(5)


def ask(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def schema_prompt(llm, name: str) -> list[int]:
    return ask(llm, f"Give me an example of a {name}, as JSON.")


def constrained(schema, **fields) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutput(json=schema), **{"max_tokens": 400, **fields})


def assert_valid(out, schema):
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


def test_every_output_parses_and_validates_greedy_and_sampled(default_llm):
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        for sampling in [dict(temperature=0)] + [dict(temperature=0.8, seed=s) for s in SEEDS]:
            prompts.append(schema_prompt(default_llm, name))
            params.append(constrained(schema, **sampling))
            schemas.append(schema)
    outs = default_llm.generate(prompts, params)
    for out, schema in zip(outs, schemas):
        assert_valid(out, schema)
    assert len({o.text for o in outs}) > len(SCHEMAS) * 3, "sampled outputs must differ"


def test_regex_choice_object_and_grammar_outputs_follow_their_constraint(default_llm):
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    cases = [
        (
            "A US phone number:",
            StructuredOutput(regex=r"\(\d{3}\) \d{3}-\d{4}"),
            lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t),
        ),
        (
            "Is the sky green?",
            StructuredOutput(choice=["yes", "no", "it depends"]),
            lambda t: t in ("yes", "no", "it depends"),
        ),
        ("Describe a cat.", StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (
            "Write a sum.",
            StructuredOutput(grammar=grammar),
            lambda t: re.fullmatch(r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)", t),
        ),
    ]
    for temperature in (0, 1.0):
        outs = default_llm.generate(
            [ask(default_llm, q) for q, _, _ in cases],
            [SamplingParams(max_tokens=100, temperature=temperature, seed=1, structured_output=c) for _, c, _ in cases],
        )
        for out, (_, _, check) in zip(outs, cases):
            assert out.finish_reason == "stop" and check(out.text), out.text


def test_each_of_n_samples_follows_the_grammar_on_its_own(default_llm):
    schema = SCHEMAS["weather"]
    out = default_llm.generate(
        schema_prompt(default_llm, "weather report"), constrained(schema, temperature=1.0, n=4, seed=3)
    )[0]
    assert len(out.outputs) == 4
    for sample in out.outputs:
        jsonschema.validate(json.loads(sample.text), schema)
    assert len({s.text for s in out.outputs}) > 1


def test_a_grammar_leaves_the_other_rows_and_seeds_unchanged(default_llm):
    free = [ask(default_llm, q) for q in ("Name a colour.", "What is 2+2?", "Say hello.")]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.token_ids for o in default_llm.generate(free, greedy)]
    schema = SCHEMAS["person"]
    seeded = constrained(schema, temperature=0.8, seed=11)
    solo_constrained = default_llm.generate(schema_prompt(default_llm, "person"), seeded)[0].token_ids
    mixed = default_llm.generate(
        free + [schema_prompt(default_llm, "person")] * 2, [greedy] * 3 + [seeded, constrained(schema)]
    )
    assert [o.token_ids for o in mixed[:3]] == alone, "unconstrained rows must not change"
    assert mixed[3].token_ids == solo_constrained, "a seeded constrained request gives the same tokens in a batch"
    assert_valid(mixed[4], schema)


def test_stop_strings_logprobs_and_penalties_under_a_grammar(default_llm):
    schema = SCHEMAS["order"]
    prompt = schema_prompt(default_llm, "shop order")
    cut, logged, penalized = default_llm.generate(
        [prompt] * 3,
        [
            constrained(schema, temperature=0, stop=[","]),
            constrained(schema, temperature=0, logprobs=3),
            constrained(schema, temperature=0.7, seed=2, repetition_penalty=1.3, presence_penalty=0.5),
        ],
    )
    assert cut.finish_reason == "stop" and "," not in cut.text and cut.text.startswith("{")
    assert_valid(logged, schema)
    assert len(logged.logprobs) == len(logged.token_ids)
    for token, entry in zip(logged.token_ids, logged.logprobs):
        assert entry["token"][0] == token and entry["token"][1] > float("-inf")
        assert entry["top"][0][1] >= entry["token"][1] - 1e-6  # greedy took the best allowed token
    assert_valid(penalized, schema)


def test_max_tokens_before_the_grammar_completes_ends_with_length_and_the_partial_text(default_llm):
    out = default_llm.generate(
        schema_prompt(default_llm, "recipe"), constrained(SCHEMAS["recipe"], temperature=0, max_tokens=6)
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_invalid_constraints_are_rejected_naming_the_field_and_the_others_keep_running(default_llm):
    engine = default_llm.engine
    good = engine.add_request(schema_prompt(default_llm, "person"), constrained(SCHEMAS["person"], temperature=0))
    engine.step()
    bad = [
        StructuredOutput(json={"type": "objectx"}, param="response_format"),
        StructuredOutput(json='{"type": ', param="guided_json"),
        StructuredOutput(regex="[a-", param="guided_regex"),
        StructuredOutput(grammar="root ::= undefined_rule", param="guided_grammar"),
    ]
    for c in bad:
        with pytest.raises(RequestRejected) as e:
            engine.add_request([1, 2, 3], SamplingParams(structured_output=c))
        assert e.value.param == c.param and f"invalid {c.kind}" in str(e.value)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [good]
    assert_valid(outs[0], SCHEMAS["person"])


def test_each_distinct_grammar_is_compiled_once(default_llm):
    grammars = default_llm.engine.grammars
    schema = {"type": "object", "properties": {"unique_field_for_this_test": {"type": "integer"}}}
    before = grammars.compiled
    default_llm.generate([ask(default_llm, "A number?")] * 4, constrained(schema, temperature=0, max_tokens=30))
    assert grammars.compiled == before + 1


def test_chunked_prefill_prefix_cache_and_preemption_keep_constrained_outputs_equal_to_solo_runs():
    llm = LLM(block_size=4, num_blocks=36, max_batch_tokens=32, max_num_seqs=8, max_model_len=144)
    system = "You answer with JSON only. " * 8  # a shared prefix, cached after the first request
    prompts, params = [], []
    schemas = dict(list(SCHEMAS.items())[:5])
    for i, (name, schema) in enumerate(schemas.items()):
        prompts.append(
            llm.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": f"A {name}?"}])
        )
        params.append(constrained(schema, temperature=0 if i % 2 else 0.8, seed=i, max_tokens=64))
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats
    assert stats.preemptions > 0, "the test must exercise preemption"
    assert stats.prefix_cache_hit_tokens > 0, "and prefix caching"
    assert max(len(p) for p in prompts) > 32, "and chunked prefill"
    solo = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == [s.token_ids for s in solo]
    for out, schema in zip(outs, schemas.values()):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) - 1


def test_cli_generate_with_a_schema_choice_and_regex(tmp_path, capsys):
    from pagedllm.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS["weather"]))
    assert (
        main(["generate", "Weather in Rome?", "--greedy", "--max-tokens", "100", "--json-schema", str(schema_file)])
        == 0
    )
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS["weather"])
    assert main(["generate", "Is water wet?", "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main(["generate", "A year?", "--regex", "(19|20)[0-9]{2}"]) == 0
    assert re.fullmatch(r"(19|20)[0-9]{2}", capsys.readouterr().out.strip())
    assert main(["generate", "x", "--regex", "[a-"]) == 1
    assert "invalid regex" in capsys.readouterr().err


@pytest.mark.parametrize("vocab", [1000, 1024, 49149])
def test_masking_leaves_exactly_the_tokens_whose_bit_is_set(kernels, vocab):
    """Both backends against the bits decoded here (token t stays iff bit t % 32 of word t // 32
    is set), with words all set, all clear and mixed, a vocabulary that is not a multiple of 32,
    and a row left out that must stay untouched."""
    import torch

    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, ::3] = -1  # every token of these words allowed
    bitmask[2, 1::3] = 0  # none
    logits = torch.randn(3, vocab, generator=g)
    before = logits.clone()
    backend = backends.get({"compiled": "cpu-compiled", "torch": "cpu-torch"}[kernels])
    backend.mask_logits(logits, bitmask, [0, 2], vocab)
    assert torch.equal(logits[1], before[1])
    token = torch.arange(vocab)
    for r in (0, 2):
        word = (bitmask[r].to(torch.int64) & 0xFFFFFFFF)[token // 32]
        allowed = ((word >> (token % 32)) & 1).bool()
        assert torch.equal(torch.isfinite(logits[r]), allowed)
        assert torch.equal(logits[r][allowed], before[r][allowed])
        assert torch.equal(logits[r][~allowed], torch.full_like(logits[r][~allowed], float("-inf")))


def test_the_mask_kernel_and_the_pytorch_fallback_mask_the_same_tokens(default_llm, kernels):
    """Both paths (compiled word-at-a-time kernel; xgrammar's own without a compiler) leave
    exactly the tokens the grammar allows, in the constrained rows only."""
    import torch

    grammars = default_llm.engine.grammars
    c = StructuredOutput(json=SCHEMAS["weather"])
    matchers = [grammars.matcher(c), None, grammars.matcher(c)]
    for token in default_llm.tokenizer.encode('{"city": "Par'):
        assert matchers[2].accept_token(token)
    vocab = default_llm.loaded.config.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    backend = backends.get({"compiled": "cpu-compiled", "torch": "cpu-torch"}[kernels])
    grammars.mask_logits(logits, matchers, backend)
    assert torch.equal(logits[1], before[1]), "an unconstrained row is untouched"
    allowed = {r: set(torch.isfinite(logits[r]).nonzero().flatten().tolist()) for r in (0, 2)}
    assert allowed[0] and allowed[2] and allowed[0] != allowed[2]
    first = default_llm.tokenizer.encode("{")
    assert first[0] in allowed[0] and len(allowed[0]) < 10  # an object must open
    assert len(allowed[2]) > 1000  # inside a string, most tokens may follow
    for r in (0, 2):
        kept = torch.isfinite(logits[r])
        assert torch.equal(logits[r][kept], before[r][kept])
