"""Server-sent events: the one writer every API's stream goes through.

An event is ``data: <JSON>`` and a blank line; Anthropic's and the Responses API's typed events
put ``event: <type>`` before it. JSON is written ASCII-only (non-ASCII as ``\\u`` escapes), so
any text, a lone surrogate from a client's JSON too, goes out as valid UTF-8.
"""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"  # the end of an OpenAI stream
STREAM = "text/event-stream"


def sse(payload: dict, event: str | None = None) -> str:
    """One server-sent event: ``payload`` as its data, ``event`` its type line (None: none)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(payload)}\n\n"
