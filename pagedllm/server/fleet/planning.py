"""Each model's plan before anything loads: the planner's own numbers (``pagedllm plan --json``
in a child process, so the front never imports torch), and what the model needs to be resident
at all, which is what the fleet shrinks it to when another model needs room."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from ...errors import PagedLLMError
from ...sizes import ceil_div
from .models import ModelSpec

# The launcher every child runs (``pagedllm`` itself, from this interpreter)
LAUNCH = ["-c", "import sys\nfrom pagedllm.cli import main\nsys.exit(main(sys.argv[1:]))"]
# A resident model's own API process (its ``pagedllm serve``), which ``pagedllm plan`` leaves
# out: the engine process's plan counts it once the server runs (``api_process_bytes``), so a
# model's share must hold it too. The API process of the default model's server measured 96-120
# MiB of RSS (tests/test_process_memory.py's runs).
API_PROCESS_BYTES = 160 * 1024**2
# The least context a shrunk model keeps: a share that holds this many tokens of one sequence
SHRUNK_CONTEXT_TOKENS = 4096


class ModelRefused(PagedLLMError):
    """A model that cannot be planned, or cannot fit the budget even alone (the planner's reason)."""


@dataclass(frozen=True)
class ModelPlan:
    need_bytes: int  # the least share it can be resident in (weights, its processes, a 4k-token cache)
    full_bytes: int  # what the planner planned under the whole budget (the share when alone)
    weights_bytes: int
    max_model_len: int


def plan_model(spec: ModelSpec, budget: int, engine_flags: list[str]) -> ModelPlan:
    """The model planned alone under ``budget`` (less its API process); ModelRefused with
    the planner's reason where it cannot fit even alone."""
    memory = str(budget - API_PROCESS_BYTES)
    command = [sys.executable, *LAUNCH, "plan", "--model", spec.path, "--memory", memory, "--json", *engine_flags]
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        plan = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = " ".join((done.stderr or done.stdout).split())[-400:]
        raise ModelRefused(f"model {spec.name!r} could not be planned: {tail}") from None
    if not plan.get("fits", False):
        raise ModelRefused(f"model {spec.name!r} does not fit in {budget} bytes even alone: {plan['error']}")
    return ModelPlan(_need(plan), plan["total_bytes"] + API_PROCESS_BYTES, plan["weights_bytes"], plan["max_model_len"])


def _need(plan: dict) -> int:
    """The plan with its cache cut to one sequence of up to SHRUNK_CONTEXT_TOKENS tokens (and its
    loading peak, if that is higher), plus the API process."""
    tokens = min(plan["max_model_len"], SHRUNK_CONTEXT_TOKENS)
    cache = ceil_div(tokens, plan["block_size"]) * plan["kv_bytes_per_block"]
    running = plan["total_bytes"] - plan["kv_cache_bytes"] + min(cache, plan["kv_cache_bytes"])
    return max(running, plan["loading_peak_bytes"]) + API_PROCESS_BYTES
