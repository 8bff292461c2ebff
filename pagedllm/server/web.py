"""The web page at ``/``: a chat with the model and the memory panel (``web/``: plain HTML, CSS
and JavaScript shipped in the package, nothing fetched from elsewhere).

The page and its files are public, like /health: they hold no data. Everything the page shows
comes from the API (``/v1/chat/completions``, ``/v1/plan``, ``/metrics``, ``/v1/memory``), which
stays behind the API key: ``/web/config.json`` tells the page whether to ask for one.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .errors import APIError

router = APIRouter(include_in_schema=False)
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
PUBLIC_PREFIX = "/web/"  # with "/" and /health, what the guards let through without the key


def _read(name: str) -> bytes:
    return (resources.files(__package__) / "web" / name).read_bytes()  # joinpath(a, b) is 3.11+


@router.get("/")
async def page() -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8")


@router.get("/web/config.json")
async def config(request: Request) -> dict:
    return {"api_key_required": request.app.state.api_key_required}


@router.get("/web/{name}")
async def file(name: str) -> Response:
    if name not in FILES:
        raise APIError(404, f"no such file: {name}", "not_found_error")
    return Response(_read(name), media_type=FILES[name] + "; charset=utf-8")
