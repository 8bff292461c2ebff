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


# ---- promises of docs/structured-output.md, each against an oracle written here -------------------

INSTALL_COMMAND = "pip install --no-deps xgrammar"  # the set-up's command, as the docs give it


def test_without_xgrammar_a_constrained_request_is_refused_with_the_install_command(default_llm, monkeypatch):
    """docs/structured-output.md: "without xgrammar a constrained request is refused with the
    command to install it" (RequestRejected, nothing queued), and the engine serves unconstrained
    requests as before. xgrammar is made unimportable (``sys.modules`` entry None) in a fresh
    engine (``default_llm`` loaded it already, so its weights come from the page cache)."""
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    llm = LLM(max_model_len=256)
    prompt = ask(llm, "Is the sky green?")
    for constraint in (StructuredOutput(choice=["yes", "no"]), StructuredOutput(json=SCHEMAS["person"])):
        with pytest.raises(RequestRejected) as e:
            llm.generate(prompt, SamplingParams(max_tokens=5, structured_output=constraint))
        assert INSTALL_COMMAND in str(e.value) and e.value.param == "structured_output", str(e.value)
    assert not llm.engine.has_unfinished()
    out = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.finish_reason in ("stop", "length") and out.text
    assert out.token_ids == default_llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0))[0].token_ids


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutput(json=SCHEMAS["person"]),
        StructuredOutput(json_object=True),
        StructuredOutput(regex="[a-z]{3}"),
        StructuredOutput(choice=["yes", "no"]),
        StructuredOutput(grammar='root ::= "a" | "b"'),
    ],
    ids=["json", "json_object", "regex", "choice", "grammar"],
)
def test_min_tokens_is_refused_for_every_kind_of_constraint(constraint):
    """docs/structured-output.md: `min_tokens` is refused with a clear error for a constrained
    request (the grammar decides where it ends): a ValueError naming the field. (`ignore_eos`:
    tests/test_tool_calls.py::test_structured_output_takes_exactly_one_constraint_and_not_with_ignore_eos.)"""
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=10, min_tokens=2, structured_output=constraint)
    SamplingParams(max_tokens=10, min_tokens=0, structured_output=constraint)  # the default is fine
    SamplingParams(max_tokens=10, min_tokens=2)  # and min_tokens without a constraint


# Constraints whose languages are finite and written out here in full: the oracle for which tokens
# a grammar allows at a step is then "the text so far plus the token's text is the start of one of
# these outputs" (or a stop token, once the text so far is a whole output), computed without
# xgrammar or anything else of pagedllm's.
FINITE_LANGUAGES = [
    ("Is the sky green?", StructuredOutput(choice=["yes", "no", "maybe", "no way"]), {"yes", "no", "maybe", "no way"}),
    (
        "In which year did the Berlin wall fall?",
        StructuredOutput(regex=r"(19|20)[0-9]{2}"),
        {f"{century}{year:02d}" for century in (19, 20) for year in range(100)},
    ),
    (
        "Write a sum.",
        StructuredOutput(grammar='root ::= "(" [1-9] " " ("+" | "-") " " [1-9] ")"'),
        {f"({a} {op} {b})" for a in range(1, 10) for op in "+-" for b in range(1, 10)},
    ),
]


def constrained_steps(llm, k: int):
    """Each step of greedy and sampled runs under every ``FINITE_LANGUAGES`` constraint with
    ``logprobs=k``: (the token drawn, its logprob entry, the set of token ids the grammar allows
    there by the oracle above)."""
    vocab = llm.loaded.config.vocab_size
    pieces = [llm.tokenizer.decode([t]) for t in range(vocab)]
    stops = set(llm.engine.eos_token_ids)
    sampling = [dict(temperature=0)] + [dict(temperature=1.0, seed=s) for s in range(4)]
    prompts, params, languages = [], [], []
    for question, constraint, outputs in FINITE_LANGUAGES:
        for fields in sampling:
            prompts.append(ask(llm, question))
            params.append(SamplingParams(max_tokens=16, logprobs=k, structured_output=constraint, **fields))
            languages.append(outputs)
    steps = []
    for out, outputs in zip(llm.generate(prompts, params), languages):
        assert out.finish_reason == "stop" and out.text in outputs, out.text
        starts = {o[:i] for o in outputs for i in range(1, len(o) + 1)}
        text = ""
        for token, entry in zip(out.token_ids, out.logprobs, strict=True):
            allowed = {t for t, piece in enumerate(pieces) if piece and text + piece in starts}
            allowed |= stops if text in outputs else set()
            steps.append((token, entry, allowed))
            text += pieces[token]
    return steps


@pytest.mark.parametrize("k", [3, 20])
def test_top_logprobs_under_a_grammar_are_the_allowed_tokens_renormalised(default_llm, k):
    """docs/structured-output.md: "Logprobs are those of the distribution the grammar left: a
    forbidden token never appears among the top ones". Every token listed with a probability is
    one the grammar allows (the oracle: the constraint's outputs written out), the top ones are
    the most likely allowed tokens, as many as asked for or as there are, and their
    probabilities are the constrained distribution's: when all allowed tokens are listed, they
    sum to 1."""
    import math

    steps = constrained_steps(default_llm, k)
    assert any(len(allowed) > 3 for *_, allowed in steps), "steps where k=3 lists only some"
    assert any(1 < len(allowed) <= k for *_, allowed in steps), "and steps where all are listed"
    for token, entry, allowed in steps:
        assert token in allowed and entry["token"][0] == token
        listed = entry["top"]
        assert {t for t, _ in listed} <= allowed, "a forbidden token has a probability"
        assert len(listed) == min(k, len(allowed)), (listed, allowed)
        mass = sum(math.exp(v) for _, v in listed)
        if len(allowed) <= k:
            assert mass == pytest.approx(1, abs=1e-4), "the constrained distribution sums to 1"
        else:
            assert mass <= 1 + 1e-4
        assert entry["token"][1] == pytest.approx(dict(listed).get(token, entry["token"][1]))


def test_no_forbidden_token_is_listed_among_the_top_logprobs(default_llm):
    """docs/structured-output.md: "a forbidden token never appears among the top ones", even
    when fewer tokens are allowed than logprobs asks for (the list is shorter then)."""
    for _, entry, allowed in constrained_steps(default_llm, 5):
        assert {t for t, _ in entry["top"]} <= allowed, entry["top"]


# ---- bounds that make constrained JSON end (pagedllm.structured.json_bounds) ---------------------


def json_accepts(schema: dict, text: str) -> bool:
    """Whether the grammar pagedllm compiles for ``schema`` accepts ``text`` whole (xgrammar's
    own matcher walks it; the oracle is the count of characters written in the test)."""
    import xgrammar as xgr

    from pagedllm.structured.grammars import _json_grammar

    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(_json_grammar(xgr, schema)), text)


@pytest.mark.parametrize(
    ("schema", "longest", "one_more"),
    [
        ({"type": "number"}, "9" * 15, "9" * 16),  # integral part: 15 digits
        ({"type": "number"}, "1." + "0" * 16, "1." + "0" * 17),  # fraction: 16
        ({"type": "number"}, "1e-308", "1e-3080"),  # exponent: 3
        ({"type": "integer"}, "-" + "9" * 15, "-" + "9" * 16),
        ({"type": "number", "minimum": 0}, "1" * 15, "1" * 16),  # a minimum leaves the top open in xgrammar
        ({"type": "integer", "minimum": 5}, "5" * 15, "5" * 16),
        ({"type": "string"}, '"' + "a" * 2048 + '"', '"' + "a" * 2049 + '"'),  # strings: 2048 characters
        ({"type": "string"}, '"' + "\\n" * 2048 + '"', '"' + "\\n" * 2049 + '"'),  # an escape is one
        ({"type": "string", "minLength": 3}, '"' + "a" * 2048 + '"', '"' + "a" * 2049 + '"'),
        ({"type": "object"}, '{"k": "' + "a" * 2048 + '"}', '{"k": "' + "a" * 2049 + '"}'),  # json_object
    ],
)
def test_numbers_and_strings_are_bounded_so_json_ends(schema, longest, one_more):
    assert json_accepts(schema, longest)
    assert not json_accepts(schema, one_more)


def test_a_schemas_own_bounds_win_over_pagedllms():
    assert json_accepts({"type": "string", "maxLength": 5000}, '"' + "a" * 5000 + '"')
    assert json_accepts({"type": "string", "minLength": 3000}, '"' + "a" * 3000 + '"')
    assert json_accepts({"type": "string", "pattern": "^a+$"}, '"' + "a" * 3000 + '"')
    assert json_accepts({"type": "integer", "maximum": 10**18}, str(10**18))
    assert json_accepts({"type": "array", "items": {"type": "integer"}}, "[" + ", ".join(["1"] * 3000) + "]")
    assert not json_accepts({"type": "number", "maximum": 100}, "100.5")  # ... and still hold
    assert json_accepts({"type": "object"}, '{"a": [1.5, -2e10, "x", {"b": null}], "c": true}')
