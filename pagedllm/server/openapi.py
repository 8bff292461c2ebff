"""The server's OpenAPI schema, made to say what the server really answers.

FastAPI's generated schema lists 200 and 422 only; pagedllm never answers 422 (bad input is a
400 with OpenAI's error body), guards every path but /health with 401 and 413, streams SSE from
the generation endpoints and serves /metrics as text. Clients and fuzzers read this schema, so
it documents each of those (tests/test_hostile_input.py fuzzes the server against it).
"""

from __future__ import annotations

from fastapi import FastAPI

ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
GUARD_ERRORS = {"401": "missing or wrong API key (with --api-key)", "413": "body over --max-body-bytes"}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")  # SSE when streamed, 404 and 429 too
GENERATION_ERRORS = {
    "400": "malformed, mistyped or out-of-range input",
    "404": "unknown model",
    "429": "more than --max-waiting queued requests (see Retry-After)",
}


def document_responses(app: FastAPI) -> None:
    generated = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generated()
        for path, operations in schema["paths"].items():
            for method, op in operations.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                errors = {k: v for k, v in GUARD_ERRORS.items() if path != "/health" or k != "401"}
                if method == "post" and path not in GENERATION_PATHS:  # /v1/memory: a refusal is a 400
                    errors["400"] = GENERATION_ERRORS["400"]
                if method == "post" and path in GENERATION_PATHS:
                    errors.update(GENERATION_ERRORS)
                    responses["200"].setdefault("content", {})["text/event-stream"] = {
                        "schema": {"type": "string", "description": "SSE chunks when stream is true"}
                    }
                if path == "/metrics":
                    responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
                if path == "/health":
                    responses["503"] = {"description": "the engine thread has failed"}
                for status, why in errors.items():
                    responses[status] = {"description": why, "content": {"application/json": {"schema": ERROR_BODY}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # (FastAPI's way to extend the schema)
