"""A model's own default sampling settings, from its ``generation_config.json``.

HF checkpoints ship one (Llama 3 Instruct: temperature 0.6, top_p 0.9; Qwen2.5: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05); the GGUF converter writes one from a GGUF's
``general.sampling.*`` metadata. Only the sampling fields are read, each only where present; an
explicit ``"do_sample": false`` means greedy, as transformers reads it. A file that is unreadable
or out of range is reported once and ignored: the model still runs, on pagedllm's own defaults.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams

log = logging.getLogger(__name__)

# GGUF metadata key -> generation_config.json key
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(model_dir: Path) -> dict[str, float]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("%s: unreadable (%s); using pagedllm's default sampling", path, e)
        return {}
    if not isinstance(config, dict):
        return {}
    found = {k: config[k] for k in MODEL_DEFAULT_FIELDS if isinstance(config.get(k), (int, float))}
    if config.get("do_sample") is False:
        found["temperature"] = 0.0
    if "top_k" in found:
        found["top_k"] = int(found["top_k"])
    try:
        SamplingParams(**found)
    except ValueError as e:
        log.warning("%s: %s; using pagedllm's default sampling", path, e)
        return {}
    return found
