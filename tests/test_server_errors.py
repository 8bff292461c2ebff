"""Whose fault an error is goes by its type: a RequestRejected is the client's 400 naming the
field, anything else on the request path (a ValueError or TypeError from a bug, a cache that
does not fit) is the server's 500, and the engine serves the next request as if nothing happened."""

import pytest

from pagedllm.errors import CacheDoesNotFitError, RequestRejected

TOKENS = {"prompt": [1, 2, 3], "max_tokens": 4}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def app(tiny_checkpoints):
    from fastapi.testclient import TestClient

    from pagedllm import LLM
    from pagedllm.server.app import create_app

    llm = LLM(str(tiny_checkpoints["llama"][0]), max_model_len=64, max_num_seqs=4)
    # a 500 is answered, not raised into the test (the app re-raises it for the server's log)
    with TestClient(create_app(llm), raise_server_exceptions=False) as client:
        yield llm, client


def once(real, error: BaseException):
    """``real``, except that its first call raises ``error``."""
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    return call


def assert_serves_on(llm, client) -> None:
    r = client.post("/v1/completions", json=TOKENS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert llm.engine.blocks.num_used == 0 and client.get("/health").json() == {"status": "ok"}


BUGS = [
    ("validate", ValueError("bug")),  # on the handler's path, before anything is queued
    ("validate", TypeError("bug")),
    ("add_request", ValueError("bug")),  # on the engine thread, as the request enters the engine
    ("add_request", CacheDoesNotFitError("bug: a cache that does not fit", {}, {})),  # a MemoryError
]


@pytest.mark.parametrize("where,error", BUGS, ids=[f"{w}-{type(e).__name__}" for w, e in BUGS])
def test_a_bug_on_the_request_path_is_a_500_and_the_next_request_is_served(app, monkeypatch, where, error):
    llm, client = app
    recoveries = llm.engine.scheduler.counters.oom_recoveries
    monkeypatch.setattr(llm.engine, where, once(getattr(llm.engine, where), error))
    r = client.post("/v1/completions", json=TOKENS)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["param"] is None
    assert llm.engine.scheduler.counters.oom_recoveries == recoveries  # not taken for a step's OOM
    assert_serves_on(llm, client)


def test_a_request_rejected_is_a_400_with_its_param_and_code(app, monkeypatch):
    llm, client = app
    r = client.post("/v1/completions", json={**TOKENS, "max_tokens": 100})  # 103 tokens > 64
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    refusal = RequestRejected("the engine refuses this", param="n", code="some_reason")
    monkeypatch.setattr(llm.engine, "validate", once(llm.engine.validate, refusal))
    r = client.post("/v1/completions", json=TOKENS)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "n", "some_reason")
    assert err["message"] == "the engine refuses this"
    assert_serves_on(llm, client)


def test_sampling_values_the_engine_refuses_are_a_400(app):
    llm, client = app
    r = client.post("/v1/completions", json={**TOKENS, "seed": 2**64})  # beyond 64 bits
    assert r.status_code == 400, r.text
    assert "seed" in r.json()["error"]["message"]
    assert_serves_on(llm, client)


class Tokenizer:
    """Just enough of a tokenizer for the chat path; ``fails`` is what its template raises."""

    chat_template = "{{ messages }}"

    def __init__(self, fails: Exception | None = None):
        self.fails = fails

    def apply_chat_template(self, messages, **kwargs) -> str:
        if self.fails is not None:
            raise self.fails
        return "rendered"


def test_a_template_that_cannot_render_the_messages_is_a_400_naming_messages(app, monkeypatch):
    llm, client = app
    r = client.post("/v1/chat/completions", json={"messages": HI})  # the tiny model has no template
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    monkeypatch.setattr(llm, "tokenizer", Tokenizer(fails=TypeError("the template says no")))
    r = client.post("/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "the template says no" in r.json()["error"]["message"]
    assert_serves_on(llm, client)


def test_a_bug_after_the_template_rendered_is_a_500(app, monkeypatch):
    llm, client = app
    monkeypatch.setattr(llm, "tokenizer", Tokenizer())
    from pagedllm import prompts

    monkeypatch.setattr(prompts, "encode", once(prompts.encode, ValueError("bug")))  # what encodes the text
    r = client.post("/v1/chat/completions", json={"messages": HI})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error"
    assert_serves_on(llm, client)
