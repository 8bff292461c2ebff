"""JSON schemas for structured-output checks: eight that cover what applications ask for
(nested objects, arrays with bounds, enums, numbers with ranges, required and optional fields,
strings with patterns), and ``distinct_schemas`` to make as many different ones as a benchmark
needs (each compiles to its own grammar).

Every string is bounded: free ones by ``maxLength``, patterns by ``{m,n}`` (xgrammar ignores
``maxLength`` beside a pattern). Under an unbounded one a 135M model may write until max_tokens,
e.g. under ``[a-z]+`` before an email's @, where it wants to write "john.doe". Bounds cost
compile time (xgrammar expands a bounded repetition): ``[a-z]{1,20}@[a-z]{1,20}`` 130 ms, the
person schema's ``[a-z0-9._]{1,12}@[a-z]{1,10}`` ~30 ms. docs/structured-output.md tells users."""

from __future__ import annotations

import copy

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z0-9._]{1,12}@[a-z]{1,10}\\.[a-z]{2,3}$"},
        },
        "required": ["name", "age"],
    },
    "address": {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 60},
            "city": {"type": "string", "maxLength": 40},
            "geo": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
            },
        },
        "required": ["street", "city", "geo"],
    },
    "tags": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4}
        },
        "required": ["tags"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "temperature", "unit"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 50},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "attendees": {"type": "integer", "minimum": 1, "maximum": 1000},
        },
        "required": ["title", "date"],
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 30},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["product", "quantity"],
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["items", "paid"],
    },
    "recipe": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "vegetarian": {"type": "boolean"},
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 5},
            "difficulty": {"enum": ["easy", "medium", "hard"]},
        },
        "required": ["name", "steps", "difficulty"],
    },
}


def distinct_schemas(n: int, start: int = 0) -> list[dict]:
    """``n`` different schemas: the eight above in turn, each copy with its own extra optional
    field, so no two compile to the same grammar."""
    out = []
    names = list(SCHEMAS)
    for i in range(n):
        schema = copy.deepcopy(SCHEMAS[names[i % len(names)]])
        schema["properties"][f"note_{start + i}"] = {"type": "string", "maxLength": 20}
        out.append(schema)
    return out
