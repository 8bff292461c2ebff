"""``POST /tokenize`` and ``POST /detokenize``, vLLM's shapes: a text's ids are transformers' for
the same tokenizer, a chat's are the very prompt /v1/chat/completions counts, ids decode back to
the text, and ids outside the vocabulary are a 400 naming ``tokens`` that stops no one."""

import pytest

pytestmark = pytest.mark.slow  # the default model

TEXTS = [
    "Hello, world!",
    "café naïve résumé Ærøskøbing",
    "日本語のテキストと中文",
    "emoji 🎉👍🏽 and a flag 🇫🇷",
    "  runs   of\n\n\twhitespace \r\n ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You speak French."},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Très bien 🎉"},
        {"role": "user", "content": "日本語は？"},
    ],
]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from pagedllm import LLM
    from pagedllm.server.app import create_app

    with TestClient(create_app(LLM(max_model_len=MAX_MODEL_LEN, max_num_seqs=4))) as client:
        yield client


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    from pagedllm.loading import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)[0]))


def ok(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_a_prompts_ids_are_transformers_ids(client, theirs, text, add_special_tokens):
    body = (
        {"prompt": text} if add_special_tokens is None else {"prompt": text, "add_special_tokens": add_special_tokens}
    )
    got = ok(client, "/tokenize", body)
    expected = theirs.encode(text, add_special_tokens=add_special_tokens is not False)  # vLLM's default: True
    assert got == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected}
    with_strs = ok(client, "/tokenize", {**body, "return_token_strs": True})
    assert with_strs["token_strs"] == theirs.convert_ids_to_tokens(expected)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_a_chats_ids_are_the_prompt_chat_completions_counts(client, theirs, messages):
    got = ok(client, "/tokenize", {"messages": messages})
    chat = ok(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert got["count"] == len(got["tokens"]) == chat["usage"]["prompt_tokens"]
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert got["tokens"] == theirs.encode(rendered, add_special_tokens=False)
    without = ok(client, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without["tokens"] == theirs.encode(rendered, add_special_tokens=False)
    assert len(without["tokens"]) < len(got["tokens"])


@pytest.mark.parametrize("text", TEXTS)
def test_ids_detokenize_back_to_their_text(client, theirs, text):
    ids = ok(client, "/tokenize", {"prompt": text})["tokens"]
    assert ok(client, "/detokenize", {"tokens": ids}) == {"prompt": text} == {"prompt": theirs.decode(ids)}


def test_ids_outside_the_vocabulary_are_a_400_naming_tokens_and_the_server_keeps_serving(client, theirs):
    for bad in ([-1], [len(theirs)], [1, 2, 2**40]):
        r = client.post("/detokenize", json={"tokens": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tokens"
    assert ok(client, "/detokenize", {"tokens": [len(theirs) - 1]})["prompt"] == theirs.decode([len(theirs) - 1])
    assert client.get("/health").json() == {"status": "ok"}
    assert ok(client, "/v1/chat/completions", {"messages": CONVERSATIONS[0], "max_tokens": 2})["choices"]


def test_what_tokenize_refuses(client):
    assert client.post("/tokenize", json={"prompt": "hi", "model": "other"}).status_code == 404
    assert client.post("/detokenize", json={"tokens": [1], "model": "other"}).status_code == 404
    r = client.post("/tokenize", json={"add_special_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/tokenize", json={"messages": [{"role": "nobody", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_a_model_without_a_tokenizer_answers_400(tiny_checkpoints):
    from fastapi.testclient import TestClient

    from pagedllm import LLM
    from pagedllm.server.app import create_app

    llm = LLM(str(tiny_checkpoints["llama"][0]), max_model_len=64, max_num_seqs=1)
    with TestClient(create_app(llm)) as client:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": [{"role": "user"}]})]:
            assert client.post(path, json=body).status_code == 400
        r = client.post("/detokenize", json={"tokens": [1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_add_special_tokens_adds_what_the_tokenizer_adds_as_transformers_does(tiny_checkpoints, tmp_path):
    """The default model's tokenizer adds nothing; this one puts a BOS first, as Llama's do."""
    import shutil

    from fastapi.testclient import TestClient
    from tiny_models import COMMON, _byte_level_vocab
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer

    from pagedllm import LLM
    from pagedllm.server.app import create_app

    shutil.copytree(tiny_checkpoints["llama"][0], tmp_path, dirs_exist_ok=True)
    tokens, merges = _byte_level_vocab(COMMON["vocab_size"] - 1)
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", len(tokens))])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "tokenizer_class": "PreTrainedTokenizerFast"}'
    )
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    with TestClient(create_app(LLM(str(tmp_path), max_model_len=64, max_num_seqs=1))) as client:
        for flag in (True, False):
            got = ok(client, "/tokenize", {"prompt": "the rest", "add_special_tokens": flag})["tokens"]
            assert got == theirs.encode("the rest", add_special_tokens=flag)
        assert ok(client, "/tokenize", {"prompt": "the rest"})["tokens"][0] == len(tokens)  # vLLM's default: added
