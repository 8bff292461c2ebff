"""Which models a fleet serves: ``NAME=PATH`` specs and the model files of a directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...engine_config import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what a request's ``model`` field says
    path: str  # a model directory (config.json) or a GGUF file


def parse_specs(values: list[str], models_dir: str | None) -> list[ModelSpec]:
    """``NAME=PATH`` each (a bare PATH is named by its file or directory), then every model of
    ``models_dir``: each subdirectory holding config.json, each ``.gguf`` file, named by its stem."""
    specs = [_spec(v) for v in values]
    if models_dir is not None:
        root = Path(models_dir)
        if not root.is_dir():
            raise ConfigError("models_dir", f"{models_dir} is not a directory")
        for entry in sorted(root.iterdir()):
            if entry.suffix == ".gguf" and entry.is_file():
                specs.append(ModelSpec(entry.stem, str(entry)))
            elif (entry / "config.json").is_file():
                specs.append(ModelSpec(entry.name, str(entry)))
    names = [s.name for s in specs]
    if not specs:
        raise ConfigError("model", "no model to serve: give --model NAME=PATH, or --models-dir with models in it")
    if len(set(names)) != len(names):
        raise ConfigError("model", f"two models share a name: {sorted(n for n in names if names.count(n) > 1)}")
    return specs


def _spec(value: str) -> ModelSpec:
    name, sep, path = value.partition("=")
    if not sep:  # a bare path
        path = value
        name = Path(value).stem if value.endswith(".gguf") else Path(value).name
    if not name or not path:
        raise ConfigError("model", f"{value!r}: give NAME=PATH")
    if not Path(path).exists():
        raise ConfigError("model", f"{name}: {path} does not exist")
    return ModelSpec(name, path)
