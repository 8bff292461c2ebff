"""The OpenAI-compatible server: the official client works against it, streaming equals
non-streaming, disconnects free their blocks, bad input is a documented 4xx and never stops
the others."""

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
import torch
from server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--memory", "2GiB", "--max-num-seqs", "64", "--max-model-len", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def seconds_until_idle(server, timeout: float = 20.0) -> float:
    """Seconds until no block is used and nothing runs (inf if not within ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.metric("pagedllm_kv_blocks_used") == 0 and server.metric("pagedllm_requests_running") == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def test_models_and_plan(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    plan = httpx.get(server.url + "/v1/plan").json()
    assert plan["num_blocks"] > 0 and plan["total_bytes"] <= plan["budget_bytes"] == 2 * 1024**3


def test_chat_with_the_openai_client(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.9, seed=7, top_p=0.9)])
def test_streamed_chat_equals_non_streamed(client, params):
    whole = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, **params)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=FRANCE, max_tokens=32, stream=True, stream_options={"include_usage": True}, **params
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]


def test_completions_text_token_ids_and_lists(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert streamed == r.choices[0].text and "Paris" in r.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 5
    many = client.completions.create(model=MODEL, prompt=["One, two,", "A, B,"], max_tokens=3, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]


def test_n_logprobs_and_stop(client):
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=8, n=3, temperature=1.0, seed=1, logprobs=True, top_logprobs=2
    )
    assert len(r.choices) == 3
    for c in r.choices:
        assert len(c.logprobs.content) >= 1 and len(c.logprobs.content[0].top_logprobs) == 2
    stopped = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stop=["Paris"])
    assert stopped.choices[0].message.content == "The capital of France is "
    lp = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=2, temperature=0, logprobs=3)
    assert len(lp.choices[0].logprobs.token_logprobs) == 2 and len(lp.choices[0].logprobs.top_logprobs[0]) == 3


def test_n_samples_of_several_prompts_stream_as_they_return_whole(client, server):
    """Prompt i's sample j is choice i * n + j, streamed or not; the samples share prompt blocks."""
    args = dict(
        model=MODEL, prompt=["Once upon a time", "The best way to"], n=3, max_tokens=12, temperature=1.0, seed=11
    )
    copied_before = server.metric("pagedllm_kv_blocks_copied_total")
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == list(range(6))
    assert len({c.text for c in whole.choices}) > 1
    assert server.metric("pagedllm_kv_blocks_copied_total") > copied_before
    texts = [""] * 6
    reasons = [None] * 6
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in whole.choices] and reasons == [c.finish_reason for c in whole.choices]


def test_32_streaming_clients_with_a_quarter_disconnecting_free_every_block(server):
    async def one(i: int, http: httpx.AsyncClient):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}."}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        text = []
        async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if i % 4 == 0 and len(text) >= 2:
                    return None  # disconnect mid-stream
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["delta"].get("content", ""))
                if line == "data: [DONE]":
                    return "".join(text)
        return None

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(i, http) for i in range(32)))

    results = asyncio.run(main())
    finished = [r for i, r in enumerate(results) if i % 4]
    assert all(r for r in finished) and len(finished) == 24
    assert seconds_until_idle(server) < float("inf")
    assert server.metric("pagedllm_requests_aborted_total") >= 8


BAD = [
    ("malformed JSON", "/v1/chat/completions", b"{not json", 400, "invalid_request_error"),
    ("wrong field type", "/v1/chat/completions", {"messages": "hello"}, 400, "invalid_request_error"),
    (
        "temperature out of range",
        "/v1/chat/completions",
        {"messages": FRANCE, "temperature": 5},
        400,
        "invalid_request_error",
    ),
    ("n out of range", "/v1/completions", {"prompt": "x", "n": 1000}, 400, "invalid_request_error"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "invalid_request_error"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "invalid_request_error"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "invalid_request_error",
    ),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": FRANCE}, 404, "not_found_error"),
    ("beyond the context", "/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "invalid_request_error"),
    (
        "too many stops",
        "/v1/completions",
        {"prompt": "hi", "stop": [str(i) for i in range(40)]},
        400,
        "invalid_request_error",
    ),
    ("token id out of vocab", "/v1/completions", {"prompt": [999999999]}, 400, "invalid_request_error"),
    (
        "logit_bias unsupported",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"1": 5}},
        400,
        "invalid_request_error",
    ),
    ("unknown path", "/v1/nothing", {}, 404, "not_found_error"),
    ("body too large", "/v1/completions", {"prompt": "x" * (5 * 1024 * 1024)}, 413, "invalid_request_error"),
]


@pytest.mark.parametrize("name,path,body,status,kind", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_error_body_and_the_server_keeps_serving(server, name, path, body, status, kind):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["message"]
    if name == "beyond the context":
        assert "100000" in err["message"] and "max_model_len=2048" in err["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


# A disconnect is noticed within DISCONNECT_CHECK_S (0.5 s) and the blocks go before the next step;
# the requests below would run for 4 s or more by themselves.
FREED_WITHIN_S = 2.0


def test_non_streaming_client_that_disconnects_is_aborted(server):
    body = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 400, "ignore_eos": True}
    aborted = server.metric("pagedllm_requests_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    assert seconds_until_idle(server) < FREED_WITHIN_S
    assert server.metric("pagedllm_requests_aborted_total") == aborted + 1


def test_a_stream_that_disconnects_frees_its_blocks_at_once(server):
    body = {"model": MODEL, "prompt": "Write a very long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    aborted = server.metric("pagedllm_requests_aborted_total")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # generating: hang up now
    assert seconds_until_idle(server) < FREED_WITHIN_S
    assert server.metric("pagedllm_requests_aborted_total") == aborted + 1


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoints):
    s = ServerProcess(
        "--model",
        str(tiny_checkpoints["llama"][0]),
        "--api-key",
        "s3cret",
        "--max-waiting",
        "2",
        "--max-num-seqs",
        "1",
        "--max-model-len",
        "512",
        "--shutdown-timeout",
        "20",
    )
    yield s
    s.stop()


def test_api_key_is_required_everywhere_but_health(tiny_server):
    url = tiny_server.url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/v1/plan"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_queue_full_answers_429_with_retry_after(tiny_server):
    auth = {"Authorization": "Bearer s3cret"}
    body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=auth) as http:
            return await asyncio.gather(*(http.post(tiny_server.url + "/v1/completions", json=body) for _ in range(12)))

    statuses = [r for r in asyncio.run(main())]
    busy = [r for r in statuses if r.status_code == 429]
    assert busy and all(r.headers.get("retry-after") for r in busy)
    assert all(r.status_code in (200, 429) for r in statuses)
    assert (
        httpx.post(
            tiny_server.url + "/v1/completions", json={"prompt": [4], "max_tokens": 2}, headers=auth, timeout=60
        ).status_code
        == 200
    )


SLOW_STEPS = """
import time
from pagedllm.engine import LLMEngine
real_step = LLMEngine.step
def step(self):
    time.sleep(0.01)  # ~100 tokens/s: a 400-token request is still running seconds later
    return real_step(self)
LLMEngine.step = step
"""
LONG = {
    "prompt": [5, 6],
    "max_tokens": 400,
    "ignore_eos": True,
    "logprobs": 0,
}  # (logprobs: the tiny model has no text to stream)


def slow_server(tiny_checkpoints, shutdown_timeout: float) -> ServerProcess:
    """The tiny qwen2 model served with slowed steps (SLOW_STEPS), so requests stay in flight."""
    model = str(tiny_checkpoints["qwen2"][0])
    args = ("--model", model, "--max-model-len", "512", "--shutdown-timeout", str(shutdown_timeout))
    return ServerProcess(*args, prelude=SLOW_STEPS)


def stream_started(url: str, events: list, body: dict) -> threading.Thread:
    """A streaming request on its own thread; returns once its first chunk has arrived."""
    first = threading.Event()

    def read():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        first.set()

    t = threading.Thread(target=read)
    t.start()
    assert first.wait(60) and events, "the stream never started"
    return t


def test_sigterm_refuses_new_requests_finishes_those_in_flight_and_exits_0(tiny_checkpoints):
    s = slow_server(tiny_checkpoints, shutdown_timeout=60)
    try:
        events: list[str] = []
        reader = stream_started(s.url, events, LONG)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10  # the handler runs between the server's loop iterations
        while httpx.get(s.url + "/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = httpx.post(s.url + "/v1/completions", json=TINY_BODY, timeout=10)
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert httpx.get(s.url + "/health", timeout=10).status_code == 503
        assert s.proc.poll() is None, "still serving what is in flight"
        reader.join(120)
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_after_the_shutdown_timeout_what_is_left_ends_with_an_error_and_the_server_exits_0(tiny_checkpoints):
    s = slow_server(tiny_checkpoints, shutdown_timeout=1)
    try:
        events: list[str] = []
        reader = stream_started(s.url, events, LONG)
        whole: dict = {}
        waiter = threading.Thread(
            target=lambda: whole.update(r=httpx.post(s.url + "/v1/completions", json=LONG, timeout=120))
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while s.metric("pagedllm_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # both requests running before the signal
        started = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        reader.join(60)
        waiter.join(60)
        assert time.monotonic() - started < 15
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and "shut down" in error["message"]
        assert whole["r"].status_code == 503 and "shut down" in whole["r"].json()["error"]["message"]
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_a_second_sigterm_stops_the_draining_server_at_once(tiny_checkpoints):
    """docs/reliability.md: after SIGTERM the server drains, and "a second signal stops at once":
    with a stream that needs 20 s or more to finish and a 120 s drain, the process is gone within
    a few seconds of the second SIGTERM, and the stream is cut."""
    slower = SLOW_STEPS.replace("time.sleep(0.01)", "time.sleep(0.05)")  # 400 tokens: >= 20 s
    model = str(tiny_checkpoints["qwen2"][0])
    s = ServerProcess("--model", model, "--max-model-len", "512", "--shutdown-timeout", "120", prelude=slower)
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    events.append(line)
                    started.set()
        except httpx.HTTPError:
            pass  # a server that stops at once may cut the stream anywhere

    reader = threading.Thread(target=read)
    try:
        reader.start()
        assert started.wait(60), "the stream never started"
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.proc.poll() is None, "draining: the stream in flight keeps the first signal from ending it"
        second = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(6)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - second
        assert s.proc.poll() is not None and took < 5, f"still running {took:.1f} s after the second SIGTERM"
        reader.join(30)
        assert not any('"finish_reason": "length"' in e for e in events), "the stream ran to its end"
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)
        s.stop()
        reader.join(30)


# ---- in this process, over the tiny model: faults a server process cannot be given ------------


@pytest.fixture
def tiny_app(tiny_checkpoints):
    from fastapi.testclient import TestClient

    from pagedllm import LLM
    from pagedllm.server.app import create_app

    llm = LLM(str(tiny_checkpoints["llama"][0]), max_model_len=64, max_num_seqs=4)
    with TestClient(create_app(llm)) as client:
        yield llm, client


TINY_BODY = {"prompt": [1, 2, 3], "max_tokens": 4}


def sse_events(client, body) -> list[str]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_non_finite_logits_are_the_servers_500_not_the_clients_400(tiny_app):
    llm, client = tiny_app
    assert client.post("/v1/completions", json=TINY_BODY).status_code == 200
    with torch.no_grad():
        llm.loaded.model.model.norm.weight.fill_(float("nan"))  # every logit is NaN from now on
    r = client.post("/v1/completions", json=TINY_BODY)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "non-finite" in err["message"]
    *_, error, done = sse_events(client, TINY_BODY)  # the 200 is sent: the error is an event
    assert json.loads(error)["error"]["type"] == "server_error" and done == "[DONE]"
    assert client.get("/health").json() == {"status": "ok"}


def test_an_engine_that_dies_fails_every_request_with_500_and_health_says_503(tiny_app):
    llm, client = tiny_app

    def broken_step():
        raise RuntimeError("injected engine bug")

    llm.engine.step = broken_step
    r = client.post("/v1/completions", json=TINY_BODY)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error" and "injected engine bug" in r.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and "injected engine bug" in health.json()["error"]


def test_abort_all_fails_running_and_queued_requests_with_a_shutdown_error(tiny_checkpoints):
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine_process.engine_thread import AsyncEngine
    from pagedllm.server.mailbox import Mailbox

    llm = LLM(str(tiny_checkpoints["llama"][0]), max_model_len=64, max_num_seqs=4)
    long = SamplingParams(max_tokens=50, ignore_eos=True)

    async def last_output(box):
        while not (out := await asyncio.wait_for(box.get(), 30)).request_finished:
            pass
        return out

    async def main():
        engine = AsyncEngine(llm.engine)
        queued = engine.add("queued", [1, 2, 3], long, Mailbox())  # not started yet: stays queued
        engine.abort_all()
        engine.start()
        try:
            failed = await last_output(queued)
            running = engine.add("running", [1, 2, 3], long, Mailbox())
            await asyncio.wait_for(running.get(), 30)
            engine.abort_all()
            aborted = await last_output(running)
        finally:
            engine.stop()
        return failed, aborted

    failed, aborted = asyncio.run(main())
    assert (failed.finish_reason, failed.error_kind) == ("error", "shutdown") and "shutting down" in failed.error
    # a running request ends with an error saying the server shut down (a 503 for its client)
    assert (aborted.finish_reason, aborted.error_kind) == ("error", "shutdown") and "shut down" in aborted.error
    assert llm.engine.blocks.num_used == 0 and not llm.engine.has_unfinished()


def test_when_the_engine_thread_dies_every_request_is_answered_at_once_and_new_ones_get_503(tiny_app):
    llm, client = tiny_app
    real_step, calls = llm.engine.step, {"n": 0}

    def dying_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected engine bug")
        return real_step()

    llm.engine.step = dying_step
    answers: list = []

    def ask():
        answers.append(client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 40}))

    # more requests than max_num_seqs=4: some are still queued when the thread dies
    askers = [threading.Thread(target=ask) for _ in range(8)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(30)
    assert not any(t.is_alive() for t in askers), "a request was never answered"
    assert sorted({r.status_code for r in answers}) in ([500], [500, 503])
    assert any("engine failure: injected engine bug" in r.text for r in answers)
    assert client.get("/health").status_code == 503
    late = client.post("/v1/completions", json=TINY_BODY)
    assert late.status_code == 503 and late.headers["Retry-After"], late.text


DYING_ENGINE = """
from pagedllm.engine import LLMEngine
real_step = LLMEngine.step
calls = [0]
def step(self):
    calls[0] += 1
    if calls[0] == 3:
        raise RuntimeError("injected engine bug")
    return real_step(self)
LLMEngine.step = step
"""


def test_a_server_whose_engine_thread_died_exits_1_for_its_supervisor(tiny_checkpoints):
    s = ServerProcess("--model", str(tiny_checkpoints["llama"][0]), "--max-model-len", "64", prelude=DYING_ENGINE)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 20}, timeout=60)
        assert r.status_code == 500 and "engine failure" in r.text
        assert s.proc.wait(timeout=60) == 1, s.log_tail()
        assert "the engine failed" in s.log_tail()
    finally:
        s.stop()


def test_an_engine_process_that_dies_fails_what_runs_answers_503_and_the_server_exits_1(tiny_checkpoints):
    """The engine killed from outside (the OOM killer, a segfault in a kernel): every request in
    flight ends with an error at once, new ones get 503, and the server exits 1 for its supervisor."""
    s = slow_server(tiny_checkpoints, shutdown_timeout=5)
    try:
        events: list[str] = []
        reader = stream_started(s.url, events, LONG)
        engine = s.engine_pid()
        assert engine is not None
        os.kill(engine, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream was never ended"
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and "engine process exited" in error["message"], events[-3:]
        assert s.proc.wait(timeout=30) == 1, s.log_tail()
    finally:
        s.stop()
