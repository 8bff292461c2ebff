"""Every model family pagedllm runs, and how a config.json or a GGUF file names its family.

A new family is a folder (``models/<family>/spec.py``, and ``model.py`` when it brings modules of
its own) and one line in ``FAMILIES``. Torch-free.
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .family import Family
from .gemma3.spec import FAMILY as GEMMA3
from .gpt_oss.spec import FAMILY as GPT_OSS
from .granite_hybrid.spec import FAMILY as GRANITE_HYBRID
from .lfm2.spec import FAMILY as LFM2
from .llama.spec import FAMILY as LLAMA
from .mistral.spec import FAMILY as MISTRAL
from .mixtral.spec import FAMILY as MIXTRAL
from .olmoe.spec import FAMILY as OLMOE
from .phi3.spec import FAMILY as PHI3
from .qwen2.spec import FAMILY as QWEN2
from .qwen2_moe.spec import FAMILY as QWEN2_MOE
from .qwen3.spec import FAMILY as QWEN3
from .qwen3_5.spec import FAMILY as QWEN3_5
from .qwen3_5_moe.spec import FAMILY as QWEN3_5_MOE
from .qwen3_moe.spec import FAMILY as QWEN3_MOE
from .qwen3_next.spec import FAMILY as QWEN3_NEXT
from .smollm3.spec import FAMILY as SMOLLM3

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA3,
    SMOLLM3,
    PHI3,
    MIXTRAL,
    OLMOE,
    QWEN2_MOE,
    QWEN3_MOE,
    GPT_OSS,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
    LFM2,
    GRANITE_HYBRID,
)

_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCHITECTURE)


def family(architecture: str) -> Family:
    """The family of an HF architecture name that ``family_of_config`` accepted."""
    return _BY_ARCHITECTURE[architecture]


def family_of_config(d: dict, source: str = "config") -> Family:
    """The family a config.json names (``architectures[0]``, else ``model_type``), or
    UnsupportedModelError listing the supported ones."""
    archs = d.get("architectures") or []
    found = _BY_ARCHITECTURE.get(archs[0]) if archs else _BY_MODEL_TYPE.get(d.get("model_type", ""))
    if found is None:
        named = archs[0] if archs else d.get("model_type")
        raise UnsupportedModelError(
            f"{source}: architecture {named!r} is not supported; pagedllm supports {', '.join(_BY_ARCHITECTURE)}"
        )
    return found


def family_of_gguf(architecture: str, has_experts: bool, source: str) -> Family:
    """The family of a GGUF file's ``general.architecture``; where a dense family and one with
    experts share it (``llama``: Llama and Mixtral), whether the file has experts decides."""
    candidates = [f for f in FAMILIES if f.gguf_architecture == architecture]
    if not candidates:
        known = sorted({f.gguf_architecture for f in FAMILIES if f.gguf_architecture})
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {architecture!r} is not supported; supported: {', '.join(known)}"
        )
    return next((f for f in candidates if (f.experts is not None) == has_experts), candidates[0])
