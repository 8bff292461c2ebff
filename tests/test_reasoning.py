"""Reasoning content: a thinking model's ``<think>`` block comes back as ``reasoning_content``, its
answer as ``content``; streamed, the deltas add up to the whole answer however the text arrives;
tool calls are read from the answer only; ``--reasoning-parser none`` gives the raw text."""

import json
import re

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_process import ServerProcess
from tiny_models import COMMON, _byte_level_vocab

from pagedllm.outputs import RequestOutput
from pagedllm.server.openai.shaping import Shape
from pagedllm.server.reading import Reader
from pagedllm.server.reasoning import Reasoning, partial_tag
from pagedllm.server.tool_calls import tool_use

# ---- the splitter, whole ------------------------------------------------------------------------

QWEN3, OPENED, R1 = Reasoning("qwen3"), Reasoning("qwen3", opened=True), Reasoning("deepseek_r1")
CONSTRAINED = Reasoning("qwen3", opened=True, constrained=True)

CASES = [
    (QWEN3, "<think>why</think>because", ("why", "because")),
    (QWEN3, "\n<think>\nwhy\n</think>\n\nbecause", ("\nwhy\n", "\n\nbecause")),
    (QWEN3, "plain answer", (None, "plain answer")),
    (QWEN3, "an answer that says </think>", (None, "an answer that says </think>")),
    (QWEN3, "<think>cut short by max_tokens", ("cut short by max_tokens", None)),
    (QWEN3, "<thi", (None, "<thi")),
    (QWEN3, "", (None, None)),
    (OPENED, "why</think>\n\nbecause", ("why", "\n\nbecause")),
    (OPENED, "<think>why</think>because", ("why", "because")),
    (OPENED, "still thinking", ("still thinking", None)),
    (OPENED, "why</think>", ("why", None)),
    (OPENED, "</think>because", ("", "because")),
    (R1, "why</think>because", ("why", "because")),
    (R1, "<think>why</think>because", ("why", "because")),
    (R1, "still thinking", ("still thinking", None)),
    (CONSTRAINED, '{"a": 1}', (None, '{"a": 1}')),
    (CONSTRAINED, 'why</think>{"a": 1}', ("why", '{"a": 1}')),
]


@pytest.mark.parametrize("reasoning, text, expected", CASES)
def test_a_finished_output_splits_into_reasoning_and_content(reasoning, text, expected):
    assert reasoning.parse(text) == expected


def test_a_partial_end_tag_is_what_may_still_become_one():
    assert [partial_tag("abc" + "</think>"[:k], "</think>") for k in range(8)] == list(range(8))
    assert partial_tag("a<b", "</think>") == 0
    assert partial_tag("ab</th", "</think>") == 4 and partial_tag("ab</th", "</think>", start=4) == 0


# ---- streamed: any chunking adds up to the whole answer ------------------------------------------


def reply(reasoning: Reasoning | None, tools=None) -> Reader:
    return Reader(reasoning, tools)


def chat_shape(r: Reader) -> Shape:
    """The chat API's shape of the answers ``r`` reads."""
    return Shape("chatcmpl-x", True, 0, "m", str, reasoning=r.reasoning is not None)


def whole(r: Reader, text: str) -> dict:
    """The chat API's whole answer's choice for the finished output ``text``."""
    return chat_shape(r).choice(r.answer(0, output(text, True)))


def output(text: str, finished: bool) -> RequestOutput:
    return RequestOutput("r", [1], text, [0] * len(text), finished, "stop" if finished else None)


def stream(r: Reader, text: str, cuts: list[int]) -> tuple[str, str, list[dict], list[str]]:
    """The (reasoning, content, tool calls, kinds of delta in order) a chat stream of ``text``
    sends when the engine hands it over in pieces ending at ``cuts``."""
    sent, reasoning, content, calls, kinds = 0, "", "", [], []
    for end in [*sorted(set(cuts)), len(text)]:
        events, _, sent = r.delta(0, output(text[:end], end == len(text)), sent)
        if not events:
            continue
        delta = chat_shape(r).delta(events)["delta"]
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
        kinds += [k for k in ("reasoning_content", "content") if delta.get(k)]
    return reasoning, content, calls, kinds


def assert_streams_the_whole(r: Reader, text: str, cuts) -> None:
    """Streamed in pieces ending at ``cuts``, ``text`` sends its whole answer's reasoning and
    content, and no reasoning after the content has begun."""
    message = whole(r, text)["message"]
    reasoning, content, _, kinds = stream(r, text, [c for c in cuts if 0 < c < len(text)])
    assert (reasoning, content) == (message.get("reasoning_content") or "", message["content"] or "")
    assert "reasoning_content" not in kinds[kinds.index("content") :] if "content" in kinds else True


PIECES = ["<think>", "</think>", "<", "</", "</th", "think>", "<thi", "a", "b", " ", "\n", "<tool_call>"]
texts = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)
parsers = st.builds(Reasoning, st.sampled_from(["qwen3", "deepseek_r1"]), st.booleans(), st.booleans())


@given(parsers, texts, st.lists(st.integers(0, 60), max_size=8))
def test_streamed_deltas_add_up_to_the_whole_split_for_any_chunking(reasoning, text, cuts):
    r = reply(reasoning)
    assert_streams_the_whole(r, text, cuts)  # in the pieces drawn
    assert_streams_the_whole(r, text, range(len(text)))  # one character at a time


@pytest.mark.parametrize("reasoning", [QWEN3, OPENED, R1, CONSTRAINED])
@pytest.mark.parametrize("text", ["a</think>b", "</th</think>", " <think>a</", "<thi<think>", "\n<think></t"])
def test_every_chunking_of_a_tricky_text_streams_its_whole_split(reasoning, text):
    for chunking in range(2 ** (len(text) - 1)):
        assert_streams_the_whole(reply(reasoning), text, [k for k in range(1, len(text)) if chunking >> (k - 1) & 1])


@given(texts, st.lists(st.integers(0, 60), max_size=8))
def test_without_a_parser_the_stream_is_the_raw_text(text, cuts):
    r = reply(None)
    message = whole(r, text)["message"]
    assert "reasoning_content" not in message and message["content"] == text
    assert stream(r, text, [c for c in cuts if c < len(text)])[:2] == ("", text)


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TOOLS = tool_use([{"type": "function", "function": {"name": "f"}}], "auto", True, "")


@pytest.mark.parametrize(
    "text, reasoning, calls",
    [
        ("why</think>\n" + CALL, "why", ["f"]),  # a call in the answer is a call
        (CALL + "</think>because", CALL, []),  # one the model thought about is not
    ],
)
def test_tool_calls_are_read_from_the_content_only(text, reasoning, calls):
    r = reply(OPENED, TOOLS)
    choice = whole(r, text)
    assert choice["message"]["reasoning_content"] == reasoning
    assert [c["function"]["name"] for c in choice["message"].get("tool_calls", [])] == calls
    streamed_reasoning, _, streamed_calls, _ = stream(r, text, list(range(len(text))))
    assert streamed_reasoning == reasoning and [c["function"]["name"] for c in streamed_calls] == calls


# ---- end to end: a tiny Qwen3 whose chat template opens a think block ---------------------------

TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]
THINK_THEN_ANSWER = "[a-z]{2,6}</think>\n\n[a-z]{2,6}"


def save_thinking_tokenizer(directory) -> None:
    """A byte-level BPE over the tiny model's vocabulary, its last four ids the chat tokens
    and ``<think>``/``</think>`` (plain added tokens, as Qwen3 has them: decoded as text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = _byte_level_vocab(COMMON["vocab_size"] - 4)
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def thinking_dir(tiny_checkpoints, tmp_path_factory):
    import shutil

    directory = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    shutil.copytree(tiny_checkpoints["qwen3"][0], directory, dirs_exist_ok=True)
    save_thinking_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def llm(thinking_dir):
    from pagedllm import LLM

    return LLM(str(thinking_dir), max_model_len=512, max_num_seqs=4)


def app_client(llm, **options):
    from fastapi.testclient import TestClient

    from pagedllm.server.app import create_app

    return TestClient(create_app(llm, **options))


def chat(client, stream: bool = False, **body):
    body = {"messages": HI, "temperature": 0, "max_tokens": 24, "stream": stream, **body}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return [e["choices"][0]["delta"] for e in events if e["choices"]]


def test_auto_turns_the_parser_on_for_a_template_that_thinks_and_only_then(llm, tiny_checkpoints):
    from pagedllm import LLM

    with app_client(llm) as client:
        assert client.app.state.reasoning_parser == "qwen3"
    plain = LLM(str(tiny_checkpoints["qwen3"][0]), max_model_len=64, max_num_seqs=1)  # no tokenizer
    with app_client(plain) as client:
        assert client.app.state.reasoning_parser is None


def test_a_thinking_answer_comes_back_as_reasoning_then_content_whole_and_streamed(llm):
    with app_client(llm) as client:
        guided = {"structured_outputs": {"regex": THINK_THEN_ANSWER}}
        message = chat(client, **guided)["message"]
        deltas = chat(client, stream=True, **guided)
    assert re.fullmatch("[a-z]{2,6}", message["reasoning_content"]), message
    assert re.fullmatch("\n\n[a-z]{2,6}", message["content"]), message
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, reverse=True)  # reasoning first, then content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_output_that_never_closes_its_think_block_is_all_reasoning(llm):
    with app_client(llm) as client:
        message = chat(client, max_tokens=8, ignore_eos=True)["message"]
    with app_client(llm, reasoning_parser="none") as client:
        raw = chat(client, max_tokens=8, ignore_eos=True)["message"]
    assert "</think>" not in raw["content"]  # (random weights: the draw that makes this test mean it)
    assert message["reasoning_content"] == raw["content"] and message["content"] is None


def test_tool_calls_are_read_from_the_answer_not_the_thinking(llm):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = r'<tool_call>\n\{"name": "f", "arguments": \{\}\}\n</tool_call>'
    with app_client(llm) as client:
        thought = chat(client, tools=tools, guided_regex=call + "</think>[a-z]{2,6}", max_tokens=100)
        answered = chat(client, tools=tools, guided_regex="[a-z]{2,6}</think>\n" + call, max_tokens=100)
    assert "tool_calls" not in thought["message"] and thought["finish_reason"] == "stop"
    assert thought["message"]["reasoning_content"].startswith("<tool_call>")
    assert [c["function"]["name"] for c in answered["message"]["tool_calls"]] == ["f"]
    assert answered["finish_reason"] == "tool_calls" and answered["message"]["content"] is None


@pytest.mark.slow
def test_serve_with_reasoning_parser_none_returns_the_raw_text(thinking_dir, llm):
    with app_client(llm) as client:
        split = chat(client, guided_regex=THINK_THEN_ANSWER)["message"]
    server = ServerProcess("--model", str(thinking_dir), "--max-model-len", "512", "--reasoning-parser", "none")
    try:
        body = {"messages": HI, "temperature": 0, "max_tokens": 24, "guided_regex": THINK_THEN_ANSWER}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    finally:
        server.stop()
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"] == split["reasoning_content"] + "</think>" + split["content"]
