"""Bounded load-and-soak test of `pagedllm serve`: a fixed number of clients send a seeded
random mix of valid, cut-short and invalid requests for a while; every answer is checked, the
server's memory and queues are sampled each second, and at the end every KV block must be free.

    .venv/bin/python tests/soak.py --duration 600            # starts its own server
    .venv/bin/python tests/soak.py --duration 120 --json soak.json -- --memory 4GiB
    .venv/bin/python tests/soak.py --url http://127.0.0.1:8000 --server-pid 1234

Arguments after `--` go to `pagedllm serve`, after the defaults (so they win). Loopback servers
only. Exit status 0 when every check passed, 1 otherwise; the report says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx
from server_process import ServerProcess, parse_metrics

DEFAULT_SERVER_ARGS = ("--memory", "2GiB", "--max-num-seqs", "32", "--max-model-len", "2048")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
REQUEST_TIMEOUT = 300.0  # a valid request slower than this under load is a failure, not a wait

# Share of each kind of request, in percent. Valid requests dominate (they are what load the
# engine); reference requests are a fifth so that a wrong answer under load shows up quickly;
# invalid ones are cheap for the server, so a quarter of the mix costs little time; the 4 MiB
# body is rare because it is the only invalid request that costs real bandwidth.
WEIGHTS = {
    "reference": 20,
    "chat": 18,
    "completion": 14,
    "long_prompt": 8,
    "disconnect": 8,
    "client_timeout": 4,
    "invalid": 27,
    "body_too_large": 1,
}

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What is 12 times 12?",
    "Give me a fun fact about cats.",
    "Count from 1 to 10.",
    "Tell me a short joke.",
]
OPENINGS = [
    "Once upon a time",
    "The best way to learn is",
    "In the year 2050,",
    "1, 2, 3, 4,",
    "The recipe for bread:",
    "Dear diary, today",
]
PARAGRAPH = (
    "The river runs past the old mill, where the miller grinds wheat into flour every "
    "morning before the market opens, and the children of the village watch the wheel turn. "
)

# Requests whose answers are computed once, one at a time, before the load starts; under load
# each must come back exactly the same (greedy: the argmax; seeded: the same draws).
REFERENCE_REQUESTS = [
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "What is 12 times 12?"}], "max_tokens": 20, "temperature": 0},
    ),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}),
    ("/v1/completions", {"prompt": "1, 2, 3, 4,", "max_tokens": 16, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Write a haiku about rain."}],
            "max_tokens": 24,
            "temperature": 0.8,
            "seed": 1234,
            "n": 2,
        },
    ),
    (
        "/v1/completions",
        {"prompt": "The best way to learn is", "max_tokens": 24, "temperature": 0.8, "seed": 42, "n": 2},
    ),
]


# ---- the server ----------------------------------------------------------------------------------


def progress(message: str) -> None:
    """One line on stderr, so a long run shows where it is; the report goes to stdout."""
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def check_loopback(url: str) -> str:
    """The generator sends thousands of requests: it may only ever aim at this machine."""
    host = urlsplit(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"refusing {url!r}: only loopback servers ({', '.join(LOOPBACK)}) may be soaked")
    return url.rstrip("/")


# ---- requests and what must come back -----------------------------------------------------------


@dataclass
class Call:
    """One request to send, and what must come back."""

    kind: str
    path: str
    body: dict | bytes
    expect: int = 200
    choices: int = 1  # how many choices a 200 must carry
    reference: list | None = None  # the exact [[text, finish_reason], ...] it must equal
    cut_after: int | None = None  # stream: hang up after this many text chunks
    timeout: float | None = None  # give up on purpose after this many seconds
    label: str = ""  # which invalid case

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")


@dataclass
class Result:
    kind: str
    status: int | str  # HTTP status, or what happened instead of one
    latency: float
    ttft: float | None = None
    problem: str | None = None  # None: exactly what was expected
    cut: bool = False  # hung up or timed out on purpose
    transport: bool = False  # a connection error nobody asked for
    reference_mismatch: bool = False
    answers: list | None = None  # [[text, finish_reason], ...] of a whole response


class Mix:
    """Builds the next request of a seeded random mix (see WEIGHTS)."""

    def __init__(self, model: str, max_len: int, max_body_bytes: int, references: list[Call]):
        self.model, self.max_len, self.max_body_bytes = model, max_len, max_body_bytes
        self.references = references
        self.kinds, self.weights = list(WEIGHTS), list(WEIGHTS.values())

    def next(self, rng: random.Random) -> Call:
        kind = rng.choices(self.kinds, self.weights)[0]
        return getattr(self, kind)(rng)

    def reference(self, rng) -> Call:
        ref = rng.choice(self.references)
        body = {**ref.body, "stream": rng.random() < 0.5}
        return Call("reference", ref.path, body, choices=ref.choices, reference=ref.reference)

    def chat(self, rng) -> Call:
        body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], **self._sampling(rng)}
        if rng.random() < 0.1:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return Call("chat", "/v1/chat/completions", body, choices=body.get("n", 1))

    def completion(self, rng) -> Call:
        prompts = rng.sample(OPENINGS, 2) if rng.random() < 0.2 else rng.choice(OPENINGS)
        if rng.random() < 0.1:  # token ids instead of text
            prompts = [rng.randrange(1000, 20000) for _ in range(rng.randint(1, 40))]
        body = {"prompt": prompts, **self._sampling(rng)}
        if rng.random() < 0.1:
            body["logprobs"] = rng.randint(0, 5)
        several = isinstance(prompts, list) and isinstance(prompts[0], str)
        return Call("completion", "/v1/completions", body, choices=body.get("n", 1) * (len(prompts) if several else 1))

    def long_prompt(self, rng) -> Call:
        """A few hundred tokens; half start with a fresh number, so the prefix cache misses."""
        text = PARAGRAPH * rng.randint(4, 9)
        if rng.random() < 0.5:
            text = f"Note {rng.randrange(10**6)}. {text}"
        params = {**self._sampling(rng), "max_tokens": rng.randint(8, 32)}
        if rng.random() < 0.5:
            body = {"messages": [{"role": "user", "content": text + "Summarize this in one sentence."}], **params}
            return Call("long_prompt", "/v1/chat/completions", body, choices=params.get("n", 1))
        body = {"prompt": text + "In short,", **params}
        return Call("long_prompt", "/v1/completions", body, choices=params.get("n", 1))

    def disconnect(self, rng) -> Call:
        """A stream the client hangs up on after 1-3 chunks: the server must abort it."""
        call = rng.choice([self.chat, self.completion])(rng)
        call.body.update(stream=True, max_tokens=rng.randint(48, 128), ignore_eos=rng.random() < 0.5)
        call.kind, call.cut_after = "disconnect", rng.randint(1, 3)
        return call

    def client_timeout(self, rng) -> Call:
        """A whole-response request the client gives up on before it can be done."""
        body = {
            "prompt": rng.choice(OPENINGS),
            "max_tokens": 128,
            "ignore_eos": True,
            "temperature": 0.7,
            "model": self.model,
        }
        return Call("client_timeout", "/v1/completions", body, timeout=rng.uniform(0.3, 1.0))

    def invalid(self, rng) -> Call:
        label, path, body, status = rng.choice(self._invalid_cases())
        return Call("invalid", path, body, expect=status, label=label)

    def body_too_large(self, rng) -> Call:
        body = {"model": self.model, "prompt": "x" * (self.max_body_bytes + 1024), "max_tokens": 1}
        return Call("body_too_large", "/v1/completions", body, expect=413, label="body over the limit")

    def _sampling(self, rng) -> dict:
        """Greedy or sampled, sometimes n = 2..4 (seeded or not), sometimes a stop string."""
        p = {"model": self.model, "max_tokens": rng.randint(4, 48), "stream": rng.random() < 0.5}
        if p["stream"] and rng.random() < 0.5:
            p["stream_options"] = {"include_usage": True}
        if rng.random() < 0.4:
            p["temperature"] = 0
        else:
            p["temperature"] = round(rng.uniform(0.5, 1.2), 2)
            p["top_p"] = rng.choice([1.0, 0.9])
        if rng.random() < 0.2:
            p["n"] = rng.randint(2, 4)
            if rng.random() < 0.5:
                p["seed"] = rng.randrange(10**6)
        if rng.random() < 0.1:
            p["stop"] = ["."]
        if rng.random() < 0.1:
            p.update(
                presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=min(2, p["max_tokens"])
            )
        return p

    def _invalid_cases(self) -> list[tuple[str, str, dict | bytes, int]]:
        q = [{"role": "user", "content": "Hi"}]
        chat, comp = "/v1/chat/completions", "/v1/completions"
        return [
            ("malformed JSON", chat, b'{"messages": [{"role": "user", "content": "Hi"}', 400),
            ("messages is a string", chat, {"messages": "hello"}, 400),
            ("max_tokens is a string", comp, {"prompt": "hi", "max_tokens": "ten"}, 400),
            ("prompt is an object", comp, {"prompt": {"text": "hi"}}, 400),
            ("max_tokens beyond the context", comp, {"prompt": "hi", "max_tokens": self.max_len + 1}, 400),
            ("prompt beyond the context", comp, {"prompt": " hello" * (self.max_len + 16), "max_tokens": 4}, 400),
            ("n above the limit", chat, {"messages": q, "n": 17}, 400),
            ("n above the limit, streamed", chat, {"messages": q, "n": 17, "stream": True}, 400),
            ("temperature -1", comp, {"prompt": "hi", "temperature": -1}, 400),
            ("17 stop strings", comp, {"prompt": "hi", "stop": [str(i) for i in range(17)]}, 400),
            ("empty messages", chat, {"messages": []}, 400),
            ("empty prompt", comp, {"prompt": ""}, 400),
            ("unknown model", chat, {"model": "gpt-9", "messages": q}, 404),
            ("model named like a file", chat, {"model": "/etc/passwd", "messages": q}, 404),
            ("model named like a relative path", comp, {"model": "../../../../etc/passwd", "prompt": "hi"}, 404),
            ("unknown path", "/v1/nothing", {"prompt": "hi"}, 404),
        ]


# ---- sending and checking -------------------------------------------------------------------------


def since(start: float) -> float:
    return time.perf_counter() - start


async def send(http: httpx.AsyncClient, url: str, call: Call) -> Result:
    """Sends one call and judges what came back; never raises for what the server does."""
    start = time.perf_counter()
    try:
        if call.stream and call.expect == 200:
            return await _send_stream(http, url, call, start)
        return await _send_whole(http, url, call, start)
    except httpx.TimeoutException as e:
        if call.timeout is not None:
            return Result(call.kind, "client timeout", since(start), cut=True)
        return Result(call.kind, "transport error", since(start), problem=f"{type(e).__name__}: {e}", transport=True)
    except httpx.TransportError as e:
        return Result(call.kind, "transport error", since(start), problem=f"{type(e).__name__}: {e}", transport=True)
    except Exception as e:  # a response shaped so oddly that a check tripped over it
        return Result(call.kind, "unchecked", since(start), problem=f"checking failed: {type(e).__name__}: {e}")


async def _send_whole(http, url, call: Call, start: float) -> Result:
    content = call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
    r = await http.post(
        url + call.path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=call.timeout or REQUEST_TIMEOUT,
    )
    latency = since(start)
    if r.status_code != call.expect:
        return Result(
            call.kind,
            r.status_code,
            latency,
            problem=f"{call.label or call.kind}: status {r.status_code}, expected {call.expect}: {r.text[:200]}",
        )
    if call.expect != 200:
        problem = check_error_body(r)
        return Result(call.kind, r.status_code, latency, problem=problem and f"{call.label}: {problem}")
    try:
        body = r.json()
        choices = body["choices"]
        answers = [[c["message"]["content"] if call.chat else c["text"], c["finish_reason"]] for c in choices]
        indices = [c["index"] for c in choices]
        expected_object = "chat.completion" if call.chat else "text_completion"
        problem = None if body.get("object") == expected_object else f"object {body.get('object')!r}"
    except (ValueError, KeyError, TypeError) as e:
        return Result(call.kind, r.status_code, latency, problem=f"malformed response ({e!r}): {r.text[:200]}")
    if indices != list(range(len(choices))):
        problem = f"choice indices {indices}"
    problem = problem or check_answers(call, answers, body.get("usage"))
    return _judged(call, r.status_code, latency, None, problem, answers)


async def _send_stream(http, url, call: Call, start: float) -> Result:
    """Reads the SSE stream (or its first chunks, for a call that hangs up on purpose)."""
    events, ttft, text_chunks = [], None, 0
    async with http.stream("POST", url + call.path, json=call.body, timeout=REQUEST_TIMEOUT) as r:
        if r.status_code != 200:
            await r.aread()
            return Result(
                call.kind, r.status_code, since(start), problem=f"stream: status {r.status_code}: {r.text[:200]}"
            )
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                return Result(call.kind, 200, since(start), problem=f"not an SSE data line: {line[:200]!r}")
            event = parse_event(line[6:])
            events.append(event)
            if event_text(event):
                text_chunks += 1
                ttft = ttft if ttft is not None else since(start)
            if call.cut_after is not None and text_chunks >= call.cut_after:
                problem = next((f"bad event: {e}" for e in events if isinstance(e, str) and e != "[DONE]"), None)
                return Result(call.kind, 200, since(start), ttft, problem, cut=True)
    return _judged(call, 200, since(start), ttft, check_stream(call, events))


def _judged(
    call: Call, status: int, latency: float, ttft: float | None, problem: str | None, answers: list | None = None
) -> Result:
    return Result(
        call.kind,
        status,
        latency,
        ttft,
        problem,
        answers=answers,
        reference_mismatch=bool(problem and problem.startswith("differs from its reference")),
    )


def parse_event(data: str) -> dict | str:
    """A chunk as a dict; "[DONE]" as is; anything unparsable as its text (a problem)."""
    if data == "[DONE]":
        return data
    try:
        event = json.loads(data)
    except ValueError:
        return data[:200]
    return event if isinstance(event, dict) else data[:200]


def event_text(event) -> str:
    if not isinstance(event, dict):
        return ""
    text = ""
    for c in event.get("choices") or []:
        text += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return text


def check_stream(call: Call, events: list) -> str | None:
    """Ends with exactly one [DONE]; one id; every choice index in range, finished exactly once
    with stop/length, nothing after its finish; a usage chunk only when asked for, last."""
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return f"stream does not end with exactly one [DONE] (last event: {str(events[-1:])[:100]})"
    texts, reasons, usage = [""] * call.choices, [None] * call.choices, None
    ids = set()
    for event in events[:-1]:
        if not isinstance(event, dict):
            return f"bad event: {event}"
        if "error" in event:
            return f"error event in stream: {json.dumps(event)[:200]}"
        if usage is not None:
            return "a chunk after the usage chunk"
        ids.add(event.get("id"))
        if event.get("usage") and not event.get("choices"):
            usage = event["usage"]
            continue
        for c in event.get("choices") or []:
            i = c.get("index")
            if not isinstance(i, int) or not 0 <= i < call.choices:
                return f"choice index {i!r} outside 0..{call.choices - 1}"
            if reasons[i] is not None:
                return f"choice {i}: a chunk after its finish_reason"
            texts[i] += ((c.get("delta") or {}).get("content") if call.chat else c.get("text")) or ""
            reasons[i] = c.get("finish_reason")
    if len(ids) != 1:
        return f"{len(ids)} different ids in one stream"
    wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
    if wants_usage != (usage is not None):
        return f"usage chunk {'missing' if wants_usage else 'not asked for'}"
    return check_answers(call, [list(a) for a in zip(texts, reasons)], usage)


def check_answers(call: Call, answers: list[list], usage: dict | None) -> str | None:
    """The right number of choices, each text finished by stop or length; usage adds up: a
    choice cut by length made exactly max_tokens tokens, none made more."""
    if len(answers) != call.choices:
        return f"{len(answers)} choices, expected {call.choices}"
    for i, (text, reason) in enumerate(answers):
        if not isinstance(text, str) or reason not in ("stop", "length"):
            return f"choice {i}: text {text!r:.60}, finish_reason {reason!r}"
    if usage is not None:
        max_tokens = call.body["max_tokens"]
        done, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        at_length = sum(reason == "length" for _, reason in answers)
        if not (
            isinstance(done, int)
            and isinstance(prompt, int)
            and prompt > 0
            and at_length * max_tokens <= done <= call.choices * max_tokens
            and usage.get("total_tokens") == prompt + done
        ):
            return (
                f"usage {usage} does not add up ({call.choices} choices, max_tokens {max_tokens}, "
                f"{at_length} at length)"
            )
    if call.reference is not None and answers != call.reference:
        return f"differs from its reference: {json.dumps(call.body)[:160]} -> {answers} != {call.reference}"
    return None


def check_error_body(r: httpx.Response) -> str | None:
    try:
        error = r.json()["error"]
        if isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str):
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return f"status {r.status_code} without an OpenAI error body: {r.text[:200]}"


# ---- sampling the server ---------------------------------------------------------------------------


@dataclass
class Sample:
    t: float  # seconds since sampling began (before the references)
    rss_mb: float | None
    kv_resident_mb: float | None  # RssShmem: the touched part of the KV cache's memory map
    running: float | None
    waiting: float | None
    blocks_used: float | None
    steps: float | None  # engine steps so far: flat while requests run = a stall


def read_memory(pid: int | None) -> tuple[float | None, float | None]:
    """(VmRSS, RssShmem) in MB. The KV cache is an anonymous shared map that the kernel fills on
    first touch, so it shows as RssShmem and grows, up to its planned size, as blocks are used."""
    if pid is None:
        return None, None
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None, None
    kb = lambda name: int(fields[name].split()[0]) if name in fields else 0  # noqa: E731
    return kb("VmRSS") / 1024, kb("RssShmem") / 1024


def read_peak(pid: int | None) -> float | None:
    """VmHWM in MB: the process's peak resident memory since it started, startup included."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, TypeError, StopIteration):
        return None


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    r = await http.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text)


async def sample_every_second(
    http, url: str, pid: int | None, t0: float, samples: list[Sample], failures: list[str], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        rss, kv = read_memory(pid)
        try:
            m = await scrape(http, url)
        except (httpx.HTTPError, ValueError) as e:
            failures.append(f"{time.monotonic() - t0:.0f} s: {type(e).__name__}: {e}")
            m = {}
        samples.append(
            Sample(
                time.monotonic() - t0,
                rss,
                kv,
                m.get("pagedllm_requests_running"),
                m.get("pagedllm_requests_waiting"),
                m.get("pagedllm_kv_blocks_used"),
                m.get("pagedllm_steps_total"),
            )
        )
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass


async def wait_idle(http, url: str, timeout: float = 60) -> dict[str, float]:
    """The server's metrics once nothing runs, waits or holds a block (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(http, url)
        busy = [m.get(f"pagedllm_{k}") for k in ("requests_running", "requests_waiting", "kv_blocks_used")]
        if busy == [0, 0, 0] or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.25)


# ---- memory verdict ---------------------------------------------------------------------------------


def longest_stall(samples: list[Sample]) -> float:
    """Longest time (s) with requests running or waiting but not one engine step: a hung engine,
    or a CPU so oversubscribed that a step takes that long. Reported, not judged."""
    longest, since_step = 0.0, None
    for prev, cur in zip(samples, samples[1:]):
        busy = (cur.running or 0) + (cur.waiting or 0) > 0
        if busy and cur.steps is not None and cur.steps == prev.steps:
            since_step = prev.t if since_step is None else since_step
            longest = max(longest, cur.t - since_step)
        else:
            since_step = None
    return longest


def slope_per_minute(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per minute."""
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def memory_summary(samples: list[Sample], run_start: float, warmup_end: float, kv_plan_mb: float | None) -> dict:
    """RSS at start / after warm-up / end / max, and the trend after warm-up.

    The trend is judged on RSS less the KV cache's resident part: that map is planned memory,
    touched lazily (prefix caching keeps freed blocks, so fresh ones get touched until all
    have been), and it is checked on its own against the plan. What is left (weights, heap,
    allocator caches) must be flat once warm: the growth fitted over the post-warm-up window
    must stay below max(48 MB, 5 %). 48 MB is above what a healthy server moves by once warm:
    a step's activations come and go between 1 s snapshots, and the allocator keeps what the
    largest batch so far needed (runs here moved by 5-20 MB after warm-up); 5 % scales that
    for bigger models. A leak crosses it once bytes per request x requests after warm-up
    passes 48 MB: 20 KB per request over 2,400 requests (a 10-minute run at ~5 requests/s).
    """
    with_rss = [s for s in samples if s.rss_mb is not None]
    if not with_rss:
        return {"measured": False}
    after = [s for s in with_rss if s.t >= warmup_end]
    out = {
        "measured": True,
        "rss_start_mb": with_rss[0].rss_mb,
        "rss_end_mb": with_rss[-1].rss_mb,
        "rss_max_mb": max(s.rss_mb for s in with_rss),
        "kv_resident_max_mb": max(s.kv_resident_mb for s in with_rss),
        "kv_plan_mb": kv_plan_mb,
        "warmup_end_s": warmup_end - run_start,
    }
    if len(after) < 5:
        return {**out, "judged": False}
    ts = [s.t for s in after]
    less_kv = [s.rss_mb - s.kv_resident_mb for s in after]
    slope = slope_per_minute(ts, less_kv)
    window_min = (ts[-1] - ts[0]) / 60
    return {
        **out,
        "judged": True,
        "rss_after_warmup_mb": after[0].rss_mb,
        "rss_slope_mb_per_min": slope_per_minute(ts, [s.rss_mb for s in after]),
        "less_kv_after_warmup_mb": less_kv[0],
        "less_kv_end_mb": less_kv[-1],
        "less_kv_slope_mb_per_min": slope,
        "less_kv_growth_mb": slope * window_min,
        "window_min": window_min,
        "growth_bound_mb": max(48.0, 0.05 * less_kv[0]),
    }


# ---- the run ------------------------------------------------------------------------------------------


async def compute_references(http, url: str, model: str) -> list[Call]:
    """Each reference request alone, before any load: the answers the loaded server must repeat."""
    refs = []
    for path, body in REFERENCE_REQUESTS:
        call = Call("reference", path, {**body, "model": model}, choices=body.get("n", 1))
        result = await send(http, url, call)
        if result.problem:
            raise RuntimeError(f"reference request failed: {result.problem}")
        call.reference = result.answers
        refs.append(call)
    return refs


async def worker(http, url: str, mix: Mix, rng: random.Random, deadline: float, results: list[Result]) -> None:
    """One client: a request at a time until the deadline. After a connection error it pauses,
    so that a dead server makes a short list of failures rather than a busy loop."""
    while time.monotonic() < deadline:
        result = await send(http, url, mix.next(rng))
        results.append(result)
        if result.transport:
            await asyncio.sleep(1.0)


async def soak(
    url: str, pid: int | None, duration: float, concurrency: int, seed: int, warmup_fraction: float, max_body_bytes: int
) -> dict:
    """Reference answers first (alone), then the load, then the wait for idle; the server is
    sampled every second throughout, so its memory before the load is the baseline."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as http, httpx.AsyncClient() as probe:
        info = (await probe.get(url + "/v1/models", timeout=30)).json()["data"][0]
        plan = await probe.get(url + "/v1/plan", timeout=30)
        kv_plan_mb = plan.json().get("kv_cache_bytes", 0) / 2**20 if plan.status_code == 200 else None
        given = plan.status_code == 200 and plan.json().get("budget_source", "").startswith("memory=")
        budget_mb = plan.json()["budget_bytes"] / 2**20 if given else None
        t0 = time.monotonic()
        samples, scrape_failures, stop = [], [], asyncio.Event()
        sampler = asyncio.create_task(sample_every_second(probe, url, pid, t0, samples, scrape_failures, stop))
        references = await compute_references(http, url, info["id"])
        progress(f"{len(references)} reference answers in {time.monotonic() - t0:.1f} s; load for {duration:.0f} s")
        mix = Mix(info["id"], info.get("max_model_len", 2048), max_body_bytes, references)
        run_start, cpu_start = time.monotonic(), time.process_time()
        results: list[Result] = []
        await asyncio.gather(
            *(
                worker(http, url, mix, random.Random(seed * 1000 + i), run_start + duration, results)
                for i in range(concurrency)
            )
        )
        elapsed, client_cpu = time.monotonic() - run_start, time.process_time() - cpu_start
        progress(f"{len(results)} requests in {elapsed:.0f} s (the last ones finished after the deadline)")
        try:
            final = await wait_idle(probe, url)
        except httpx.HTTPError as e:
            final = {}
            scrape_failures.append(f"at the end: {type(e).__name__}: {e}")
        progress(f"idle after {time.monotonic() - run_start - elapsed:.1f} s")
        stop.set()
        await sampler
    memory = memory_summary(samples, run_start - t0, run_start - t0 + warmup_fraction * duration, kv_plan_mb)
    memory["longest_stall_s"] = longest_stall(samples)
    memory["rss_peak_mb"], memory["budget_mb"] = read_peak(pid), budget_mb
    return build_report(
        results,
        elapsed,
        final,
        memory,
        samples,
        scrape_failures,
        dict(
            concurrency=concurrency,
            seed=seed,
            duration_asked_s=duration,
            warmup_fraction=warmup_fraction,
            model=info["id"],
            url=url,
            client_cpu_s=client_cpu,
        ),
    )


# ---- the report ------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def kind_table(results: list[Result]) -> dict:
    table = {}
    for kind in WEIGHTS:
        mine = [r for r in results if r.kind == kind]
        done = [r.latency for r in mine if not r.cut and not r.transport]
        ttfts = [r.ttft for r in mine if r.ttft is not None]
        table[kind] = {
            "count": len(mine),
            "wrong": sum(r.problem is not None for r in mine),
            "cut_on_purpose": sum(r.cut for r in mine),
            "latency_p50_s": percentile(done, 0.5),
            "latency_p99_s": percentile(done, 0.99),
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99),
        }
    return table


def verdict(results: list[Result], final: dict, memory: dict, scrape_failures: list[str]) -> list[str]:
    """Why the run failed; empty when it passed."""
    reasons = []

    def examples(rs: list[Result]) -> str:
        return "; ".join(f"[{r.kind}] {r.problem}" for r in rs[:3])

    five = [r for r in results if isinstance(r.status, int) and r.status >= 500]
    transport = [r for r in results if r.transport]
    mismatched = [r for r in results if r.reference_mismatch]
    wrong = [
        r
        for r in results
        if r.problem
        and not r.reference_mismatch
        and not r.transport
        and not (isinstance(r.status, int) and r.status >= 500)
    ]
    if not any(r.status == 200 and not r.problem for r in results):
        reasons.append("no valid request was answered")
    if five:
        reasons.append(f"{len(five)} responses with a 5xx status: {examples(five)}")
    if transport:
        reasons.append(f"{len(transport)} transport errors nobody asked for: {examples(transport)}")
    if mismatched:
        reasons.append(f"{len(mismatched)} reference requests answered differently under load: {examples(mismatched)}")
    if wrong:
        reasons.append(f"{len(wrong)} wrong answers or statuses: {examples(wrong)}")
    busy = {k: final.get(f"pagedllm_{k}") for k in ("kv_blocks_used", "requests_running", "requests_waiting")}
    if any(v != 0 for v in busy.values()):
        reasons.append(f"not idle at the end: {busy}")
    if scrape_failures:
        reasons.append(f"{len(scrape_failures)} /metrics scrapes failed: {scrape_failures[:3]}")
    if memory.get("judged") and memory["less_kv_growth_mb"] > memory["growth_bound_mb"]:
        reasons.append(
            f"RSS less the KV cache grew {memory['less_kv_growth_mb']:.0f} MB after warm-up "
            f"({memory['less_kv_slope_mb_per_min']:.1f} MB/min; bound {memory['growth_bound_mb']:.0f} MB)"
        )
    if memory.get("budget_mb") and memory.get("rss_peak_mb") and memory["rss_peak_mb"] > memory["budget_mb"]:
        reasons.append(f"peak RSS {memory['rss_peak_mb']:.0f} MB exceeds the budget {memory['budget_mb']:.0f} MB")
    if memory.get("kv_plan_mb") and memory.get("measured") and memory["kv_resident_max_mb"] > memory["kv_plan_mb"] + 16:
        reasons.append(
            f"KV cache resident {memory['kv_resident_max_mb']:.0f} MB, above its plan {memory['kv_plan_mb']:.0f} MB"
        )
    return reasons


def build_report(results, elapsed, final, memory, samples, scrape_failures, settings) -> dict:
    statuses = Counter(str(r.status) for r in results)
    reasons = verdict(results, final, memory, scrape_failures)
    return {
        "settings": settings,
        "duration_s": elapsed,
        "requests": len(results),
        "requests_per_s": len(results) / elapsed if elapsed else 0.0,
        "by_kind": kind_table(results),
        "by_status": dict(sorted(statuses.items())),
        "memory": memory,
        "final": {k: v for k, v in final.items() if k.startswith("pagedllm_") and not k.endswith("_created")},
        "problems": [asdict(r) for r in results if r.problem][:50],
        "samples": [asdict(s) for s in samples],
        "passed": not reasons,
        "reasons": reasons,
    }


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def format_report(report: dict) -> str:
    s, m, f = report["settings"], report["memory"], report["final"]
    lines = [
        f"pagedllm soak: {report['duration_s']:.0f} s, {s['concurrency']} clients, seed {s['seed']}, "
        f"model {s['model']} at {s['url']}",
        f"server: {s.get('server_command') or '(external)'}"
        + (f" (log: {s['server_log']})" if s.get("server_log") else ""),
        "",
        f"{'kind':<16}{'count':>7}{'wrong':>7}{'cut':>6}{'p50 ms':>9}{'p99 ms':>9}{'TTFT p50':>10}{'TTFT p99':>10}",
    ]
    for kind, k in report["by_kind"].items():
        lines.append(
            f"{kind:<16}{k['count']:>7}{k['wrong']:>7}{k['cut_on_purpose']:>6}{ms(k['latency_p50_s']):>9}"
            f"{ms(k['latency_p99_s']):>9}{ms(k['ttft_p50_s']):>10}{ms(k['ttft_p99_s']):>10}"
        )
    lines.append(
        f"{'total':<16}{report['requests']:>7}   ({report['requests_per_s']:.2f} requests/s; "
        f"this client used {s['client_cpu_s']:.1f} s of CPU)"
    )
    lines.append("by status: " + ", ".join(f"{k}: {v}" for k, v in report["by_status"].items()))
    if m.get("measured"):
        lines.append(
            f"RSS: start {mb(m['rss_start_mb'])}, after warm-up ({m['warmup_end_s']:.0f} s) "
            f"{mb(m.get('rss_after_warmup_mb'))}, end {mb(m['rss_end_mb'])}, max {mb(m['rss_max_mb'])}"
            + (f", slope after warm-up {m['rss_slope_mb_per_min']:+.1f} MB/min" if m.get("judged") else "")
        )
        lines.append(f"KV cache resident: max {mb(m['kv_resident_max_mb'])} of {mb(m['kv_plan_mb'])} planned")
        if m.get("rss_peak_mb") is not None:
            budget = f" (budget {mb(m['budget_mb'])}: memory= bounds it)" if m.get("budget_mb") else ""
            lines.append(f"peak RSS (VmHWM, start-up included): {mb(m['rss_peak_mb'])}{budget}")
        if m.get("judged"):
            lines.append(
                f"RSS less KV cache: {mb(m['less_kv_after_warmup_mb'])} -> {mb(m['less_kv_end_mb'])}, "
                f"slope {m['less_kv_slope_mb_per_min']:+.2f} MB/min, growth over {m['window_min']:.1f} min "
                f"{m['less_kv_growth_mb']:+.1f} MB (bound {m['growth_bound_mb']:.0f} MB)"
            )
        else:
            lines.append("RSS trend: not judged (run too short)")
    else:
        lines.append("RSS: not measured (give --server-pid)")
    lines.append(f"longest time with requests queued and no engine step: {m.get('longest_stall_s', 0):.0f} s")
    lines.append(
        "at the end: "
        + ", ".join(f"{k} {f.get('pagedllm_' + k)}" for k in ("kv_blocks_used", "requests_running", "requests_waiting"))
    )
    counters = ("requests_finished", "requests_aborted", "requests_failed", "preemptions")
    lines.append("server counters: " + ", ".join(f"{k} {f.get(f'pagedllm_{k}_total', 0):.0f}" for k in counters))
    lines.append("")
    lines.append("PASS" if report["passed"] else "FAIL")
    lines.extend(f"  - {r}" for r in report["reasons"])
    return "\n".join(lines)


# ---- entry points ------------------------------------------------------------------------------------------


def run(
    duration: float = 600,
    concurrency: int = 16,
    seed: int = 0,
    url: str | None = None,
    server_pid: int | None = None,
    server_args: list[str] = (),
    warmup_fraction: float = 0.25,
    max_body_bytes: int = 4 * 1024 * 1024,
    json_path: str | None = None,
) -> dict:
    """Runs a soak against ``url``, or against a server it starts (and stops) itself; returns
    the report, with ``passed`` and ``reasons``."""
    server = None
    if url is None:
        started = time.monotonic()
        server = ServerProcess(*DEFAULT_SERVER_ARGS, *server_args)
        url, server_pid = server.url, server.pid
        progress(f"server up in {time.monotonic() - started:.1f} s: {' '.join(server.command)}")
    try:
        report = asyncio.run(
            soak(check_loopback(url), server_pid, duration, concurrency, seed, warmup_fraction, max_body_bytes)
        )
    finally:
        stopping = time.monotonic()
        exit_code = server.stop(keep_log=True) if server else None
        if server:
            progress(f"server exited {exit_code} {time.monotonic() - stopping:.1f} s after SIGTERM")
    if server:
        report["settings"]["server_command"] = " ".join(server.command)
        if exit_code != 0:
            report["passed"] = False
            report["reasons"].append(f"the server exited {exit_code} on SIGTERM:\n{server.log_tail()}")
        if report["passed"]:
            server.remove_log()
        else:  # kept for the post-mortem
            report["settings"]["server_log"] = server.log.name
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        prog="python tests/soak.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--concurrency", type=int, default=16, help="clients, each one request at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=0.25, help="share of the run before RSS must be flat")
    ap.add_argument("--url", default=None, help="a running server (loopback only); default: start one")
    ap.add_argument("--server-pid", type=int, default=None, help="its process id, to sample its RSS")
    ap.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="the server's body limit")
    ap.add_argument("--json", default=None, help="also write the full report (with samples) here")
    args = ap.parse_args(own)
    if args.url is not None:
        check_loopback(args.url)
        if server_args:
            ap.error("server arguments after -- only apply to a server this command starts")
    elif args.server_pid is not None:
        ap.error("--server-pid goes with --url (a server this command starts is sampled anyway)")
    report = run(
        args.duration,
        args.concurrency,
        args.seed,
        args.url,
        args.server_pid,
        server_args,
        args.warmup,
        args.max_body_bytes,
        args.json,
    )
    print(format_report(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
