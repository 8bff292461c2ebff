"""pagedllm's own tokenizer (``loading/tokenizer.py``) encodes, decodes and renders chat templates
exactly as transformers' ``PreTrainedTokenizerFast`` does with the same files, and loading it
never imports transformers (that import alone is the memory this module exists to save)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pagedllm.loading import load_tokenizer, resolve_model_dir
from pagedllm.loading.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "café naïve résumé Ærøskøbing",
    "日本語のテキストと中文",
    "emoji 🎉👍🏽 and a flag 🇫🇷",
    "  runs   of\n\n\twhitespace \r\n ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><repo_name>x<|im_end|>",
    "",
    " ",
    "don't , stop .",
]

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You speak French."},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Très bien 🎉"},
        {"role": "user", "content": "日本語は？"},
    ],
]

# Qwen-like, with the features real templates use: tools as JSON, namespace, loop controls, a
# {% generation %} block, whitespace control, a role check that raises.
TOOL_TEMPLATE = """
{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}

# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
<|im_end|>
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
  {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role: ' + message.role) }}
  {%- endif %}
  {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}{{ message.content | default('') }}{% endgeneration %}
{%- else %}{{ message.content }}{% endif %}
  {%- if message.tool_calls is defined %}
    {%- for call in message.tool_calls %}
<tool_call>{{ call.function | tojson(indent=2) }}</tool_call>
    {%- endfor %}
  {%- endif %}
<|im_end|>
  {%- if ns.turns >= max_turns | default(99) %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- if not enable_thinking | default(true) %}<think></think>{% endif %}
{% endif %}
{{- bos_token ~ '|' ~ eos_token ~ '|' ~ (pad_token or '') }}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo à Zürich — 天気",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,  # dropped before rendering, as transformers does
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
    },
    {"role": "tool", "content": "22°C"},
]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir(None)[0]


@pytest.fixture(scope="module")
def ours(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def theirs(model_dir):
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


@pytest.fixture
def both_with(ours, theirs):
    """Sets a chat template on both tokenizers for one test."""
    saved = ours.chat_template, theirs.chat_template

    def use(template):
        ours.chat_template = theirs.chat_template = template

    yield use
    ours.chat_template, theirs.chat_template = saved


def theirs_render(theirs, messages, **kwargs):
    return theirs.apply_chat_template(messages, tokenize=False, **kwargs)


# ---- the default model's tokenizer --------------------------------------------------------------


@pytest.mark.slow  # loads the default model
def test_load_tokenizer_returns_pagedllms_tokenizer_for_a_tokenizer_json(model_dir):
    assert isinstance(load_tokenizer(model_dir), Tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == theirs.encode(text, add_special_tokens=True)


def test_decode_equals_transformers_on_random_ids_including_special_ids(ours, theirs):
    rng = random.Random(0)
    n = len(theirs)
    for _ in range(500):
        ids = [rng.randrange(20) if rng.random() < 0.25 else rng.randrange(n) for _ in range(rng.randrange(16))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    for text in TEXTS:  # round trips, and a single id
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(2) == theirs.decode(2)


def test_special_tokens_match_transformers(ours, theirs):
    for name in ("bos_token", "eos_token", "bos_token_id", "eos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.eos_token_id is not None
    assert ours.special_tokens == theirs.special_tokens_map


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_the_default_chat_template_renders_like_transformers(ours, theirs, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == theirs_render(theirs, messages, add_generation_prompt=add_generation_prompt)
    ids = ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        (CONVERSATIONS[2], {"add_generation_prompt": True}),
        (CONVERSATIONS[2], {"add_generation_prompt": True, "enable_thinking": False, "max_turns": 2}),
        (TOOL_CHAT, {"tools": TOOLS}),
        (TOOL_CHAT, {"tools": TOOLS, "add_generation_prompt": True, "bos_token": "<override>"}),
        (TOOL_CHAT, {}),
    ],
)
def test_a_template_with_tools_tojson_and_loop_controls_renders_like_transformers(
    both_with, ours, theirs, messages, kwargs
):
    both_with(TOOL_TEMPLATE)
    assert ours.apply_chat_template(messages, **kwargs) == theirs_render(theirs, messages, **kwargs)


def test_a_template_that_raises_fails_like_transformers(both_with, ours, theirs):
    both_with(TOOL_TEMPLATE)
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role: wizard"):
        ours.apply_chat_template(bad)
    with pytest.raises(jinja2.TemplateError, match="unknown role: wizard"):
        theirs_render(theirs, bad)
    both_with("{% for m in messages %}{{ m.content }")  # does not parse
    with pytest.raises(jinja2.TemplateSyntaxError):
        ours.apply_chat_template(bad)


def test_an_enormous_range_fails_instead_of_hanging(both_with, ours):
    both_with("{% for i in range(10 ** 9) %}x{% endfor %}")
    with pytest.raises(OverflowError, match="MAX_RANGE"):
        ours.apply_chat_template(CONVERSATIONS[1])


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ cycler.__init__.__globals__ }}",
        "{{ dict.__class__.__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{% set _ = messages.append(1) %}",
    ],
)
def test_a_template_cannot_escape_the_sandbox_or_edit_the_messages(both_with, ours, hostile):
    both_with(hostile)
    messages = [dict(m) for m in CONVERSATIONS[0]]
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(messages)
    assert messages == CONVERSATIONS[0]


def test_the_chat_template_is_settable_and_the_helpers_exist(both_with, ours):
    both_with("{{ strftime_now('%Y') }}|{{ {'k': 'é'} | tojson }}|{{ dict(a=1) | tojson(separators=(',', ':')) }}")
    year, plain, compact = ours.apply_chat_template(CONVERSATIONS[1]).split("|")
    assert len(year) == 4 and year.isdigit()
    assert plain == '{"k": "é"}' and compact == '{"a":1}'


def test_empty_conversations_and_missing_templates_are_value_errors(both_with, ours):
    with pytest.raises(ValueError):
        ours.apply_chat_template([])
    both_with(None)
    with pytest.raises(ValueError):
        ours.apply_chat_template(CONVERSATIONS[1])


@pytest.mark.slow  # loads the default model
def test_loading_and_using_the_tokenizer_never_imports_transformers(model_dir):
    code = (
        "import sys; from pathlib import Path; from pagedllm.loading import load_tokenizer; "
        f"t = load_tokenizer(Path({str(model_dir)!r})); "
        "t.decode(t.encode('hi')); t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
        "print(type(t).__name__, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["Tokenizer", "False"]


# ---- other tokenizer files: built here, compared with transformers loading the same files -------

CORPUS = ["Hello, world! Don't stop.", "café naïve résumé", "日本語 テキスト", "the quick brown fox , jumps ."] * 20
OTHER_TEXTS = [*TEXTS, "[CLS] a [SEP] [MASK]", "<s>a</s> <eot>hi<eot>", "<extra_1> yo <image>", "can 't it 's"]


def _wordpiece(d: Path) -> None:
    """BERT-like: a post-processor adding [CLS]/[SEP], truncation saved in the file, and the
    clean-up of spaces before punctuation switched on (transformers applies it to WordPiece)."""
    t = RustTokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    t.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    cls, sep = t.token_to_id("[CLS]"), t.token_to_id("[SEP]")
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    t.enable_truncation(8)
    t.save(str(d / "tokenizer.json"))
    names = dict(zip(("unk_token", "cls_token", "sep_token", "pad_token", "mask_token"), specials))
    (d / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": True, **names}))


def _bpe(d: Path, specials: list[str]) -> None:
    t = RustTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    t.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=alphabet)
    )
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    t.save(str(d / "tokenizer.json"))


def _bpe_with_legacy_map(d: Path) -> None:
    """An EOS only ``special_tokens_map.json`` names (as a dict) and the vocabulary lacks: it is
    added. Clean-up requested but ignored (BPE). Templates listed by name in the config."""
    _bpe(d, ["<s>"])
    templates = [{"name": "default", "template": "D{{ eos_token }}"}, {"name": "tool_use", "template": "T"}]
    config = {"clean_up_tokenization_spaces": True, "bos_token": "<s>", "chat_template": templates}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    eos = {"content": "<eot>", "lstrip": False, "rstrip": True, "normalized": False, "single_word": False}
    legacy = {"eos_token": eos, "additional_special_tokens": ["<extra_1>"]}
    (d / "special_tokens_map.json").write_text(json.dumps(legacy))


def _bpe_with_added_tokens_decoder(d: Path, split_special_tokens: bool = False) -> None:
    """The config's ``added_tokens_decoder`` adds a token and changes another's flags; tokens given
    as AddedToken dicts; a model-specific ``image_token``; the legacy map ignored (config wins);
    template files over the config's template."""
    _bpe(d, ["<s>", "</s>"])

    def added(content, special, lstrip=False):
        return {
            "content": content,
            "lstrip": lstrip,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }

    config = {
        "added_tokens_decoder": {"0": added("<s>", True), "1": added("</s>", False, True), "400": added("<eot>", True)},
        "bos_token": {"__type": "AddedToken", **added("<s>", True)},
        "eos_token": "</s>",
        "image_token": "<image>",
        "extra_special_tokens": ["<extra_1>"],
        "split_special_tokens": split_special_tokens,
        "chat_template": "from the config",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eot>"}))
    (d / "chat_template.jinja").write_text("{{ image_token }}{{ messages[0]['content'] }}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "rag.jinja").write_text("R{{ documents | tojson }}")


@pytest.mark.parametrize(
    "build",
    [
        _wordpiece,
        _bpe_with_legacy_map,
        _bpe_with_added_tokens_decoder,
        lambda d: _bpe_with_added_tokens_decoder(d, split_special_tokens=True),
    ],
    ids=["wordpiece-cleanup", "bpe-legacy-map", "bpe-added-tokens-decoder", "bpe-split-special-tokens"],
)
def test_other_tokenizer_files_behave_like_transformers(tmp_path, build):
    build(tmp_path)
    ours, theirs = Tokenizer.from_dir(tmp_path), PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for text in OTHER_TEXTS:
        for add in (False, True):
            assert ours.encode(text, add) == theirs.encode(text, add_special_tokens=add), (text, add)
    assert ours.backend.get_vocab_size() == len(theirs)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(12))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    for name in ("bos_token", "eos_token", "bos_token_id", "eos_token_id", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.special_tokens == theirs.special_tokens_map
    chat = [{"role": "user", "content": "hi"}]
    if ours.chat_template is not None:
        for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "rag", "documents": [{"title": "t", "text": "é"}]}):
            assert ours.apply_chat_template(chat, **kwargs) == theirs_render(theirs, chat, **kwargs), kwargs


def test_the_files_exercise_what_they_claim(tmp_path):
    """Guards the comparisons above against testing nothing: each file set changes the output."""
    (tmp_path / "wp").mkdir()
    _wordpiece(tmp_path / "wp")
    wp = Tokenizer.from_dir(tmp_path / "wp")
    assert wp.decode(wp.encode("hello , world .")) == "hello, world."
    assert wp.encode("hello", add_special_tokens=True)[0] == wp.backend.token_to_id("[CLS]")
    assert len(wp.encode("hello world " * 10)) > 8  # the saved truncation is off

    (tmp_path / "legacy").mkdir()
    _bpe_with_legacy_map(tmp_path / "legacy")
    legacy = Tokenizer.from_dir(tmp_path / "legacy")
    assert RustTokenizer.from_file(str(tmp_path / "legacy" / "tokenizer.json")).token_to_id("<eot>") is None
    assert legacy.eos_token == "<eot>" and legacy.encode("a<eot>")[-1] == legacy.eos_token_id is not None
    assert legacy.decode(legacy.encode("a <eot>"), skip_special_tokens=True) == "a "
    assert legacy.apply_chat_template([{"role": "user", "content": "x"}], tools=TOOLS) == "T"

    (tmp_path / "added").mkdir()
    _bpe_with_added_tokens_decoder(tmp_path / "added", split_special_tokens=True)
    added = Tokenizer.from_dir(tmp_path / "added")
    assert added.special_tokens["image_token"] == "<image>"
    assert len(added.encode("<eot>")) > 1  # split_special_tokens: special text is plain text
    assert added.apply_chat_template([{"role": "user", "content": "x"}]) == "<image>x"
