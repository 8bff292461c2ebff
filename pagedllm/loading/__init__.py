"""Turns what the user named (nothing, a model directory, a .gguf file) into weights and tokenizer.

Every path ends in an HF-style directory: a GGUF file is converted once into the cache, then
loaded like any checkpoint. Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..models import DecoderLM
from ..sizes import torch_dtype
from .checkpoint import load_decoder
from .default_model import DEFAULT_MODEL_NAME, default_gguf_path
from .gguf_convert import converted_dir

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer, or None for a weights-only directory
    path: Path  # the HF-style directory the weights came from
    name: str


def resolve_model_dir(model: str | Path | None) -> tuple[Path, str]:
    """(HF-style directory, display name) for what the user named."""
    if model is None:
        return converted_dir(default_gguf_path()), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a model directory needs config.json and *.safetensors")
        return path, path.name
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        return converted_dir(path), path.stem
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such file or directory. pagedllm loads a local HF directory "
            "(config.json + *.safetensors) or a .gguf file; it never downloads from a model hub"
        )
    raise ModelLoadError(f"{path}: not a model directory or a .gguf file")


def load(model: str | Path | None = None, dtype: str | torch.dtype = "float32") -> LoadedModel:
    model_dir, name = resolve_model_dir(model)
    return load_dir(model_dir, name, dtype)


def load_dir(model_dir: Path, name: str, dtype: str | torch.dtype = "float32") -> LoadedModel:
    decoder = load_decoder(model_dir, torch_dtype(dtype))
    return LoadedModel(decoder, decoder.config, load_tokenizer(model_dir), model_dir, name)


def load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
