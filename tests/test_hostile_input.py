"""Hostile input: whatever a client sends, the server answers with a documented status and
OpenAI's error body, never a 5xx; it keeps serving, and every KV block comes back.

Two parts. Schemathesis generates requests from the server's own OpenAPI schema, valid and
invalid (its "all" mode), against a live `pagedllm serve`, and checks every answer against the
statuses README.md documents. Then each documented limit is tried at its edge: accepted at the
limit where that is affordable, refused just beyond it.

Schemathesis runs through its command line, not its pytest plugin: the plugin of 4.32 does not
run under pytest 9.2 (it sets ``item._nodeid``, which pytest 9.2 no longer has).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import httpx
import pytest
from server_process import ServerProcess
from tiny_models import COMMON

from pagedllm.server.openapi import ERROR_BODY

pytestmark = pytest.mark.slow

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
C, CHAT = "/v1/completions", "/v1/chat/completions"

# README.md: "Errors use OpenAI's error body" (ERROR_BODY, as the server declares it); 401 on
# every path but /health, 413 everywhere, and for the generation endpoints 400 (bad input),
# 404 (unknown model), 429 (queue full).
# A stream has answered 200 before it ends: an engine failure would show only as an error event.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "not": {"pattern": '"server_error"'}}},
}
EVERY_PATH_ERRORS = {"401": "missing or wrong API key", "413": "body over --max-body-bytes"}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
GENERATION_ERRORS = {
    "400": "malformed, mistyped or out-of-range input",
    "404": "unknown model",
    "429": "more than --max-waiting queued requests",
}
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
]


class Server:
    """A `pagedllm serve` subprocess with the API key, and its log to show with a failure."""

    def __init__(self, *args: str, key: str | None = KEY):
        self.process = ServerProcess(*args, *(["--api-key", key] if key else []))
        self.url = self.process.url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def log(self) -> str:
        return self.process.log_tail(300)

    def post(self, path: str, body, timeout: float = 120, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=timeout, **kw)

    def metric(self, name: str) -> float:
        return self.process.metric(name, headers=self.headers)

    def stop(self) -> None:
        self.process.stop()


def assert_still_serving(server: Server, valid_request: tuple[str, dict]) -> None:
    """Healthy, answers a valid request, holds no KV block and no request, logged no traceback."""
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}, server.log
    path, body = valid_request
    r = server.post(path, body)
    assert r.status_code == 200, (r.text, server.log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        idle = [
            server.metric(m)
            for m in ("pagedllm_kv_blocks_used", "pagedllm_requests_running", "pagedllm_requests_waiting")
        ]
        if idle == [0, 0, 0]:
            break
        time.sleep(0.2)
    assert idle == [0, 0, 0], f"blocks used, running, waiting = {idle}"
    assert "Traceback" not in server.log, server.log


def documented(openapi: dict) -> dict:
    """The server's OpenAPI schema, checked to declare the statuses and media types README.md
    documents (and no 422, which pagedllm never answers), with this test's own statement of the
    error body and a stricter SSE event (no error event inside a 200 stream) put in."""
    for path, operations in openapi["paths"].items():
        for method, op in operations.items():
            responses = op["responses"]
            assert "422" not in responses, (method, path)
            errors = {k: v for k, v in EVERY_PATH_ERRORS.items() if path != "/health" or k != "401"}
            if method == "post" and path not in GENERATION_PATHS:  # /v1/memory: its refusal is a 400
                errors["400"] = GENERATION_ERRORS["400"]
            if method == "post" and path in GENERATION_PATHS:
                errors.update(GENERATION_ERRORS)
                assert "text/event-stream" in responses["200"]["content"], (method, path)
                responses["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
            if path == "/metrics":
                assert list(responses["200"]["content"]) == ["text/plain"]
            for status, why in errors.items():
                assert status in responses, (method, path, status)
                responses[status] = {"description": why, "content": {"application/json": {"schema": ERROR_BODY}}}
    return openapi


# Applied by schemathesis before each call: a max_tokens the context would accept (or none,
# which means "the rest of the context") is cut to a few tokens, so that a run takes seconds, not
# hours, on two CPU cores; one beyond the context is left as generated, so its refusal is fuzzed.
CAP_MAX_TOKENS_HOOK = """
import schemathesis

@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if value is None or (type(value) is int and {cap} < value <= {context}):
                body[field] = {cap}
"""


def run_schemathesis(
    server: Server,
    tmp_path,
    *,
    max_examples: int,
    hooks: str | None = None,
    only_post: bool = False,
    timeout: float = 300,
) -> str:
    """Runs `st run` (phases examples, coverage, fuzzing; positive and negative data) against
    the live server and fails with schemathesis' own report (each failure with its curl)."""
    openapi = httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=30).json()
    schema = tmp_path / "openapi.json"
    schema.write_text(json.dumps(documented(openapi)))
    config = tmp_path / "schemathesis.toml"
    config_lines = []
    if hooks:
        (tmp_path / "hooks.py").write_text(hooks)
        config_lines.append(f'hooks = "{tmp_path / "hooks.py"}"')
    config.write_text("\n".join(config_lines) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        str(schema),
        "--url",
        server.url,
        "--mode",
        "all",
        "--max-examples",
        str(max_examples),
        "--seed",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        "--checks",
        ",".join(CHECKS),
        "--workers",
        "1",
        "--request-timeout",
        "120",
        "--generation-database",
        "none",
        "--continue-on-failure",
        "--no-color",
        "--output-sanitize",
        "false",
        "--output-truncate",
        "false",
        *(["--include-method", "POST"] if only_post else []),
        # an operator's control, not a request: a fuzzed budget would resize the server under test
        # (tests/test_elastic_memory.py tests it, the refusals included)
        *("--exclude-path", "/v1/memory"),
        *[a for name, value in server.headers.items() for a in ("-H", f"{name}: {value}")],
    ]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[report.find("=== FAILURES") :] if "FAILURES" in report else report
    return report


# ---- the tiny model: token-id prompts run; text and chat get 400 (it has no tokenizer) ------


TINY_CONTEXT = 64
TINY_VOCAB = COMMON["vocab_size"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoints):
    return tiny_checkpoints["llama"][0]


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    # A short context makes a request that fills it cheap to run; --max-num-seqs 16 lets the
    # documented n <= 16 run whole. The other limits are the defaults under test.
    s = Server("--model", str(tiny_dir), "--max-num-seqs", "16", "--max-model-len", str(TINY_CONTEXT))
    yield s
    s.stop()


TINY_VALID = (C, {"prompt": [1, 2, 3], "max_tokens": 4})


def test_fuzzed_requests_to_the_tiny_model_get_documented_statuses_only(tiny_server, tmp_path):
    run_schemathesis(
        tiny_server, tmp_path, max_examples=25, hooks=CAP_MAX_TOKENS_HOOK.format(cap=8, context=TINY_CONTEXT)
    )
    assert_still_serving(tiny_server, TINY_VALID)


# ---- each documented limit at its edge (the tiny model: fast, token ids) ---------------------

HI = [{"role": "user", "content": "hi"}]


def ids(n: int) -> list[int]:
    return [1 + i % (TINY_VOCAB - 1) for i in range(n)]


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    return err


EDGES = [  # name, path, body, status, the error's param (None: not checked)
    ("max_tokens filling the context", C, {"prompt": ids(4), "max_tokens": TINY_CONTEXT - 4}, 200, None),
    ("max_tokens one past the context", C, {"prompt": ids(4), "max_tokens": TINY_CONTEXT - 3}, 400, "max_tokens"),
    ("max_tokens far past the context", C, {"prompt": ids(4), "max_tokens": 10**30}, 400, "max_tokens"),
    ("max_tokens 0", C, {"prompt": ids(4), "max_tokens": 0}, 400, "max_tokens"),
    ("max_completion_tokens 0", CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("prompt filling the context", C, {"prompt": ids(TINY_CONTEXT - 1), "max_tokens": 1}, 200, None),
    ("prompt one past the context", C, {"prompt": ids(TINY_CONTEXT), "max_tokens": 1}, 400, None),
    ("n 16", C, {"prompt": ids(2), "max_tokens": 2, "n": 16}, 200, None),
    ("n 17", C, {"prompt": ids(2), "max_tokens": 2, "n": 17}, 400, "n"),
    ("n 0", C, {"prompt": ids(2), "max_tokens": 2, "n": 0}, 400, "n"),
    ("logprobs 20", C, {"prompt": ids(2), "max_tokens": 2, "logprobs": 20}, 200, None),
    ("logprobs 21", C, {"prompt": ids(2), "max_tokens": 2, "logprobs": 21}, 400, "logprobs"),
    ("logprobs -1", C, {"prompt": ids(2), "max_tokens": 2, "logprobs": -1}, 400, "logprobs"),
    ("top_logprobs 21", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs -1", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("16 stop strings", C, {"prompt": ids(2), "max_tokens": 2, "stop": [f"s{i}" for i in range(16)]}, 200, None),
    ("17 stop strings", C, {"prompt": ids(2), "max_tokens": 2, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("a stop string of 256 characters", C, {"prompt": ids(2), "max_tokens": 2, "stop": "s" * 256}, 200, None),
    ("a stop string of 257 characters", C, {"prompt": ids(2), "max_tokens": 2, "stop": ["s" * 257]}, 400, "stop"),
    ("an empty stop string", C, {"prompt": ids(2), "max_tokens": 2, "stop": [""]}, 400, "stop"),
    ("1025 messages", CHAT, {"messages": HI * 1025, "max_tokens": 1}, 400, "messages"),
    ("no message", CHAT, {"messages": [], "max_tokens": 1}, 400, "messages"),
    ("256 prompts", C, {"prompt": [[i] for i in ids(256)], "max_tokens": 1}, 200, None),
    ("257 prompts", C, {"prompt": [[i] for i in ids(257)], "max_tokens": 1}, 400, "prompt"),
    ("the last token id of the vocabulary", C, {"prompt": [TINY_VOCAB - 1], "max_tokens": 1}, 200, None),
    ("a token id past the vocabulary", C, {"prompt": [TINY_VOCAB], "max_tokens": 1}, 400, "prompt"),
    ("a negative token id", C, {"prompt": [3, -1], "max_tokens": 1}, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,status,param", EDGES, ids=[e[0] for e in EDGES])
def test_each_limit_is_accepted_at_its_edge_and_refused_past_it(tiny_server, name, path, body, status, param):
    r = tiny_server.post(path, body)
    if status != 200:
        err = error_of(r, status)
        assert err["type"] == "invalid_request_error", err
        if param is not None:
            assert (err["param"] or "").split(".")[0] == param, err
        if "context" in name:
            assert err["code"] == "context_length_exceeded", err
        elif "token id" in name:  # a bad token id is not a prompt that is too long
            assert err["code"] != "context_length_exceeded", err
        return
    assert r.status_code == 200, r.text
    out = r.json()
    prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
    assert len(out["choices"]) == len(prompts) * body.get("n", 1)
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    if name.startswith("max_tokens"):
        assert out["usage"]["completion_tokens"] == body["max_tokens"]  # the tiny model has no EOS
    if "logprobs" in body:
        assert all(len(top) == body["logprobs"] for c in out["choices"] for top in c["logprobs"]["top_logprobs"])


LIMIT = 4 * 1024 * 1024  # --max-body-bytes, by default


def body_of_size(size: int) -> bytes:
    base = {"prompt": [1, 2], "max_tokens": 1, "user": ""}
    pad = size - len(json.dumps(base).encode())
    body = json.dumps({**base, "user": "x" * pad}).encode()
    assert len(body) == size
    return body


def in_chunks(data: bytes, size: int = 64 * 1024):
    """A body sent with chunked transfer encoding: no Content-Length to refuse it by."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_at_the_size_limit_is_served_and_one_byte_more_is_413(tiny_server, chunked):
    headers = {**tiny_server.headers, "content-type": "application/json"}
    for size, status in ((LIMIT, 200), (LIMIT + 1, 413)):
        body = body_of_size(size)
        r = httpx.post(tiny_server.url + C, content=in_chunks(body) if chunked else body, headers=headers, timeout=120)
        if status == 200:
            assert r.status_code == 200, r.text
        else:
            assert str(LIMIT) in error_of(r, 413)["message"]
    assert_still_serving(tiny_server, TINY_VALID)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_model_field_names_only_the_served_model_never_a_path_or_another_model(tiny_server, tiny_dir):
    served = [m["id"] for m in httpx.get(tiny_server.url + "/v1/models", headers=tiny_server.headers).json()["data"]]
    assert len(served) == 1
    rss_before = rss_bytes(tiny_server.process.proc.pid)
    names = [
        "/etc/passwd",
        "../x",
        "../../../../etc/passwd",
        "file:///etc/passwd",
        str(tiny_dir),
        f"{tiny_dir}/../{tiny_dir.name}",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        DEFAULT_MODEL,
        "gpt-4o",
        "",
        " ",
        served[0].upper(),
        served[0] + "\x00",
    ]
    for name in names:
        for path, body in ((C, {"prompt": [1, 2], "max_tokens": 1}), (CHAT, {"messages": HI, "max_tokens": 1})):
            err = error_of(tiny_server.post(path, {**body, "model": name}), 404)
            assert (err["type"], err["param"], err["code"]) == ("not_found_error", "model", "model_not_found")
    assert [
        m["id"] for m in httpx.get(tiny_server.url + "/v1/models", headers=tiny_server.headers).json()["data"]
    ] == served
    # nothing was loaded: the default model's weights alone would be ~500 MiB more
    assert rss_bytes(tiny_server.process.proc.pid) - rss_before < 64 * 1024**2
    assert tiny_server.post(C, {"prompt": [1, 2], "max_tokens": 1, "model": served[0]}).status_code == 200
    assert tiny_server.post(C, {"prompt": [1, 2], "max_tokens": 1, "model": None}).status_code == 200


def app_routes(tiny_dir) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, the schema's and FastAPI's own (/docs, ...), read
    from an app built like the server's, so a new endpoint is covered without editing this."""
    from pagedllm import LLM
    from pagedllm.server.app import create_app

    app = create_app(LLM(str(tiny_dir), max_model_len=TINY_CONTEXT, max_num_seqs=1), api_key=KEY)
    routes = {(method, route.path) for route in app.routes for method in getattr(route, "methods", None) or ()}
    routes |= {(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops}
    assert {("GET", "/health"), ("GET", "/metrics"), ("POST", C), ("POST", CHAT), ("GET", "/docs")} <= routes
    return sorted(routes)


def test_the_api_key_is_required_on_every_route_but_health(tiny_server, tiny_dir):
    url = tiny_server.url
    for method, path in app_routes(tiny_dir) + [("GET", "/no/such/path"), ("POST", "/v1/nothing")]:
        if path in ("/health", "/", "/web/config.json", "/web/{name}"):  # the page and its files hold no data
            assert httpx.request(method, url + path.replace("{name}", "app.js")).status_code == 200
            continue
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
            {"X-Api-Key": KEY},
        ):
            if path == "/v1/messages" and "X-Api-Key" in headers:
                continue  # Anthropic's API takes its key there (tests/test_messages_api.py)
            r = httpx.request(method, url + path, headers=headers, json={} if method == "POST" else None)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            if method != "HEAD":
                assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.request(method, url + path, headers=AUTH, json={} if method == "POST" else None)
        assert r.status_code != 401, (method, path)


UNSUPPORTED = [
    (C, {"suffix": "x"}, "suffix"),
    (C, {"best_of": 2}, "best_of"),
    (C, {"logit_bias": {"1": 5}}, "logit_bias"),
    # a model without a tokenizer has no vocabulary to build a grammar over
    (C, {"response_format": {"type": "json_object"}}, "response_format"),
    (C, {"guided_regex": "[0-9]+"}, "guided_regex"),
]


@pytest.mark.parametrize("path,extra,param", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_fields_are_refused_when_set(tiny_server, path, extra, param):
    body = {"prompt": [1, 2]} if path == C else {"messages": HI}
    err = error_of(tiny_server.post(path, {**body, "max_tokens": 1, **extra}), 400)
    assert err["param"] == param, err


MISTYPED = [
    ("a boolean as a token id", {"prompt": [[False]]}, "prompt"),
    ("a string as max_tokens", {"max_tokens": "2"}, "max_tokens"),
    ("a boolean as n", {"n": True}, "n"),
    ("a string as stream", {"stream": "true"}, "stream"),
]


@pytest.mark.parametrize("name,extra,param", MISTYPED, ids=[m[0] for m in MISTYPED])
def test_mistyped_input_is_400_not_coerced(tiny_server, name, extra, param):
    """README: "malformed or mistyped input ... -> 400": a value of another JSON type than the
    schema's is refused, not converted (OpenAI's API refuses them too)."""
    err = error_of(tiny_server.post(C, {"prompt": [1, 2], "max_tokens": 1, **extra}), 400)
    assert (err["param"] or "").split(".")[0] == param, err


def test_a_wrong_method_is_405_with_allow(tiny_server):
    for method, path, allowed in (("DELETE", C, "POST"), ("TRACE", "/v1/models", "GET"), ("PUT", "/metrics", "GET")):
        r = httpx.request(method, tiny_server.url + path, headers=tiny_server.headers)
        assert r.status_code == 405, r.text
        assert allowed in r.headers.get("allow", ""), (method, path, dict(r.headers))


@pytest.fixture
def own_tiny_server(tiny_dir):
    """A server of its own, for requests that once stopped the engine for everyone."""
    s = Server("--model", str(tiny_dir), "--max-num-seqs", "4", "--max-model-len", str(TINY_CONTEXT))
    yield s
    s.stop()


def test_a_seed_at_the_edges_of_64_bits_is_served_or_refused_never_stops_the_engine(own_tiny_server):
    """Sample i of a request draws from seed + i (README): no seed may overflow the generator."""
    for n, seed in itertools.product(
        (1, 2), (-(2**63) - 1, -(2**63), -1, 2**63 - 1, 2**64 - 2, 2**64 - 1, 2**64, 10**30)
    ):
        r = own_tiny_server.post(C, {"prompt": [1, 2], "max_tokens": 2, "n": n, "seed": seed})
        assert r.status_code in (200, 400), (seed, n, r.status_code, r.text)
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["param"] == "seed" or "seed" in err["message"], (seed, n, err)
    assert_still_serving(own_tiny_server, TINY_VALID)


# ---- the default model: text prompts and chat run too -----------------------------------------

DEFAULT_CONTEXT = 2048


@pytest.fixture(scope="module")
def default_server():
    s = Server("--memory", "2GiB", "--max-num-seqs", "32", "--max-model-len", str(DEFAULT_CONTEXT))
    yield s
    s.stop()


DEFAULT_VALID = (CHAT, {"messages": HI, "max_tokens": 4})


def test_fuzzed_requests_to_the_default_model_get_documented_statuses_only(default_server, tmp_path):
    run_schemathesis(
        default_server,
        tmp_path,
        max_examples=10,  # the coverage phase (~500 boundary cases) runs whole regardless
        only_post=True,
        hooks=CAP_MAX_TOKENS_HOOK.format(cap=4, context=DEFAULT_CONTEXT),
    )
    assert_still_serving(default_server, DEFAULT_VALID)


def test_chat_limits_at_their_edges(default_server):
    r = default_server.post(CHAT, {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 20})
    assert r.status_code == 200, r.text
    assert all(len(t["top_logprobs"]) == 20 for t in r.json()["choices"][0]["logprobs"]["content"])
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    past = {"messages": HI, "max_completion_tokens": DEFAULT_CONTEXT - prompt_tokens + 1}
    assert error_of(default_server.post(CHAT, past), 400)["code"] == "context_length_exceeded"
    r = default_server.post(CHAT, {"messages": HI, "max_tokens": 2, "stop": ["s" * 256] * 16})
    assert r.status_code == 200, r.text
    # 1024 messages pass the count (their template is longer than the context); 1025 do not
    err = error_of(default_server.post(CHAT, {"messages": HI * 1024, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded", err
    err = error_of(default_server.post(CHAT, {"messages": HI * 1025, "max_tokens": 1}), 400)
    assert err["param"] == "messages" and "1024" in err["message"], err


def test_text_prompt_limits_at_their_edges(default_server):
    r = default_server.post(C, {"prompt": "Once upon a time", "max_tokens": 1})
    assert r.status_code == 200, r.text
    past = {"prompt": "Once upon a time", "max_tokens": DEFAULT_CONTEXT - r.json()["usage"]["prompt_tokens"] + 1}
    assert error_of(default_server.post(C, past), 400)["code"] == "context_length_exceeded"
    r = default_server.post(C, {"prompt": ["a b"] * 256, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 256, r.text
    err = error_of(default_server.post(C, {"prompt": ["a b"] * 257, "max_tokens": 1}), 400)
    assert err["param"] == "prompt", err
