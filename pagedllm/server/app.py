"""The OpenAI-compatible HTTP API over one AsyncEngine.

Every error is OpenAI's error body with the right status; bad input is a 4xx and never touches
the engine, so everyone else keeps being served. A client that goes away aborts its request at
once, which frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RequestRejected
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, QueueFull
from .mailbox import Mailbox
from .metrics import Metrics, ThroughputMeter
from .openapi import document_responses
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def create_app(
    llm,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    max_waiting: int = 256,
    shutdown_timeout: float = 30.0,
) -> FastAPI:
    engine = AsyncEngine(llm.engine, max_waiting=max_waiting)
    throughput = ThroughputMeter()
    engine.observers.append(throughput.observe)
    model_name = served_model_name or llm.loaded.name
    metrics = Metrics(llm.engine, throughput, model_name)
    max_len = llm.engine.max_model_len
    # Tokenizing (a body may carry megabytes of text) runs on one worker thread, not on the
    # event loop, which must keep streaming to everyone else meanwhile.
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizer_thread, fn, *args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s; memory plan:\n%s", model_name, llm.memory_plan.table())
        yield
        # Connections are closed (or given up on) by now; finish or abort what is left.
        deadline = time.monotonic() + shutdown_timeout
        while engine.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(llm.engine.requests):
            engine.abort(rid)
        engine.stop()
        tokenizer_thread.shutdown(wait=False)

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    document_responses(app)
    app.state.engine = engine
    app.state.metrics = metrics

    # ---- errors ------------------------------------------------------------------------------

    def respond_error(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        metrics.count_error(status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return respond_error(e.status, error_body(e.message, e.type, e.param, e.code), e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            message, where = "the request body is not valid JSON", None
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return respond_error(400, error_body(message, "invalid_request_error", where))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return respond_error(e.status_code, error_body(str(e.detail), kind), e.headers)  # (405: Allow)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("internal error")
        return respond_error(500, error_body("internal server error", "server_error"))

    # ---- guards: API key, body size (plain ASGI, so streaming and disconnects pass through) ----

    app.add_middleware(Guards, api_key=api_key, max_body_bytes=max_body_bytes, on_error=metrics.count_error)

    # ---- simple endpoints ----------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": str(engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": 0, "owned_by": "pagedllm", "max_model_len": max_len}
            ],
        }

    @app.get("/v1/plan")
    async def plan():
        return llm.memory_plan.to_dict()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # ---- generation ----------------------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def sampling_params(req, prompt_len: int, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(1, max_len - prompt_len)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                stop=req.stop,
                n=req.n,
                min_tokens=min(req.min_tokens, max_tokens),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def submit(prompts: list[list[int]], req, max_tokens, logprobs) -> tuple[str, list[str], Mailbox]:
        """Validates every prompt first, then queues them all on one shared sink. Each is one
        engine request for ``n`` samples, which share the prompt's KV blocks."""
        base = uuid.uuid4().hex[:24]
        jobs = []
        for p_index, prompt in enumerate(prompts):
            params = sampling_params(req, len(prompt), max_tokens, logprobs)
            try:
                engine.validate(prompt, params)
            except RequestRejected as e:
                raise rejected(e, prompt) from None
            jobs.append((f"{base}-{p_index}", prompt, params))
        sink = Mailbox()
        ids = []
        try:
            for rid, prompt, params in jobs:
                engine.add(rid, prompt, params, sink)
                ids.append(rid)
        except QueueFull as e:
            for rid in ids:
                engine.abort(rid)
            raise APIError(
                429, f"server busy: {e}; retry later", "rate_limit_error", headers={"Retry-After": "1"}
            ) from None
        return base, ids, sink

    def rejected(e: RequestRejected, prompt: list[int]) -> APIError:
        """The 400 for a request the engine refused, naming the field to blame."""
        message = str(e)
        if message.startswith("n="):
            return APIError(400, message, param="n")
        if "exceeds max_model_len" in message:
            param = "prompt" if len(prompt) >= max_len else "max_tokens"
            return APIError(400, message, param=param, code="context_length_exceeded")
        return APIError(400, message, param="prompt")

    async def outputs_of(request: Request, ids: list[str], n: int, sink: Mailbox):
        """Yields (choice index, output) until every request finished; aborts all on disconnect.
        Request i's sample j is choice i * n + j."""
        first_choice = {rid: i * n for i, rid in enumerate(ids)}
        open_ids = set(ids)
        last_time: dict[tuple[str, int], float] = {}
        next_check = time.monotonic() + 0.5
        try:
            while open_ids:
                if time.monotonic() >= next_check:  # outputs may never pause: check on a clock
                    if await request.is_disconnected():
                        return
                    next_check = time.monotonic() + 0.5
                try:
                    out = await asyncio.wait_for(sink.get(), timeout=0.5)
                except TimeoutError:
                    continue
                now, key = time.perf_counter(), (out.request_id, out.index)
                if out.token_ids and key not in last_time and out.metrics:
                    metrics.ttft.observe(now - out.metrics.arrival_time)
                elif key in last_time and out.token_ids:
                    metrics.itl.observe(now - last_time[key])
                last_time[key] = now
                if out.request_finished:
                    open_ids.discard(out.request_id)
                yield first_choice[out.request_id] + out.index, out
        finally:
            for rid in open_ids:
                engine.abort(rid)

    def usage(prompts: list[list[int]], completion_tokens: int, n: int) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def token_text(token_id: int) -> str:
        return llm.tokenizer.decode([token_id]) if llm.tokenizer is not None else str(token_id)

    def chat_logprobs(out, start: int, end: int) -> dict | None:
        if out.logprobs is None:
            return None
        content = []
        for lp in out.logprobs[start:end]:
            tid, value = lp["token"]
            tok = token_text(tid)
            content.append(
                {
                    "token": tok,
                    "logprob": value,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())}
                        for t, v in lp["top"]
                    ],
                }
            )
        return {"content": content}

    def completion_logprobs(out, start: int, end: int) -> dict | None:
        if out.logprobs is None:
            return None
        entries = out.logprobs[start:end]
        return {
            "tokens": [token_text(lp["token"][0]) for lp in entries],
            "token_logprobs": [lp["token"][1] for lp in entries],
            "top_logprobs": [{token_text(t): v for t, v in lp["top"]} for lp in entries],
            "text_offset": [],
        }

    def fail_on_error(out) -> None:
        if out.finish_reason == "error":
            raise APIError(
                500 if "engine failure" in (out.error or "") else 400,
                out.error or "request failed",
                "server_error" if "engine failure" in (out.error or "") else "invalid_request_error",
            )

    async def generate(request: Request, req, prompts: list[list[int]], max_tokens, logprobs, chat: bool):
        created = int(time.time())
        base, ids, sink = submit(prompts, req, max_tokens, logprobs)
        obj = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + base
        make_logprobs = chat_logprobs if chat else completion_logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                stream(
                    request,
                    ids,
                    req.n,
                    sink,
                    rid,
                    obj + ".chunk" if chat else obj,
                    created,
                    prompts,
                    include_usage,
                    chat,
                    make_logprobs,
                ),
                media_type="text/event-stream",
            )
        finals: dict[int, object] = {}
        num_choices = len(ids) * req.n
        async for i, out in outputs_of(request, ids, req.n, sink):
            fail_on_error(out)
            if out.finished:
                finals[i] = out
        if len(finals) < num_choices:
            return Response(status_code=499)  # the client went away
        choices = []
        for i in range(num_choices):
            out = finals[i]
            lp = make_logprobs(out, 0, len(out.token_ids))
            if chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": lp,
                        "finish_reason": out.finish_reason,
                    }
                )
            else:
                choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason})
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": usage(prompts, completion_tokens, req.n),
        }

    async def stream(request, ids, n, sink, rid, obj, created, prompts, include_usage, chat, make_logprobs):
        def chunk(choices: list, **extra) -> str:
            return (
                "data: "
                + json.dumps(
                    {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices, **extra}
                )
                + "\n\n"
            )

        if chat:
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(len(ids) * n)
                ]
            )
        sent = [0] * (len(ids) * n)
        completion_tokens = 0
        async for i, out in outputs_of(request, ids, n, sink):
            if out.finish_reason == "error":
                yield "data: " + json.dumps(error_body(out.error or "request failed", "server_error")) + "\n\n"
                break
            lp = make_logprobs(out, sent[i], len(out.token_ids))
            sent[i] = len(out.token_ids)
            if not out.delta_text and not out.finished and not lp:
                continue
            reason = out.finish_reason if out.finished and out.finish_reason != "abort" else None
            if chat:
                delta = {"content": out.delta_text} if out.delta_text else {}
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": i, "text": out.delta_text, "logprobs": lp, "finish_reason": reason}
            if out.finished:
                completion_tokens += len(out.token_ids)
            yield chunk([choice])
        if include_usage:
            yield chunk([], usage=usage(prompts, completion_tokens, n))
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        raw = req.prompt
        if isinstance(raw, str):
            texts = [raw]
        elif isinstance(raw[0], int):
            texts = [raw]
        else:
            texts = raw
        prompts = []
        for p in texts:
            if isinstance(p, str):
                try:
                    prompts.append(await off_loop(llm.engine.encode, p))
                except RequestRejected as e:
                    raise APIError(400, str(e), param="prompt") from None
            else:
                prompts.append(list(p))
        if any(not p for p in prompts):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return await generate(request, req, prompts, req.max_tokens, req.logprobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = await off_loop(llm.apply_chat_template, messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # a template that fails on these messages is the request's problem
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await generate(request, req, [prompt], max_tokens, logprobs, chat=True)

    return app


class Guards:
    """Rejects requests without the API key (all paths but /health; compared in constant time)
    and bodies larger than ``max_body_bytes`` (by header, and by counting what arrives)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_error):
        self.app, self.api_key, self.limit, self.on_error = app, api_key, max_body_bytes, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return await self._reject(
                    scope, receive, send, 401, "missing or wrong API key", "authentication_error", "invalid_api_key"
                )
        length = headers.get("content-length")
        too_large = f"request body exceeds {self.limit} bytes"
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._reject(scope, receive, send, 413, too_large)
        # Read the whole body (at most the limit) before the app sees any of it: a chunked body
        # has no length to check up front, and the app must never get a part of one.
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                return await self._reject(scope, receive, send, 413, too_large)
            if not message.get("more_body"):
                break
        body = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():  # the body once, then the real channel (disconnects)
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send, status, message, type_="invalid_request_error", code=None):
        self.on_error(status)
        await JSONResponse(error_body(message, type_, code=code), status_code=status)(scope, receive, send)
