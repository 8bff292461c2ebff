"""EngineConfig: every knob of an engine, in one typed object, validated in one place.

Built once, from ``LLM(...)``'s keyword arguments (``EngineConfig.from_options``) or from the
command line (``add_flags`` makes the flags of ``generate``, ``chat``, ``serve``, ``bench`` and
``plan`` from the fields below; ``from_args`` reads them back), then handed unchanged to the
memory planner and the engine. A field left None is solved for by the planner (the cache, the
step budget, the context) or takes its documented default. Torch-free: ``pagedllm plan`` starts
without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import PagedLLMError
from .sizes import KV_CACHE_DTYPES, QUANTIZATIONS, SUPPORTED_DTYPES, dtype_name, kv_dtype_name, parse_memory

BACKENDS = ("auto", "cpu-compiled", "cpu-torch")  # pagedllm.backends.NAMES (a level above: tests/test_backends.py)
SPECULATIVE_METHODS = ("ngram", "draft_model")  # engine.speculative.NgramProposer, engine.drafter.DraftModel
# LLM(speculative={...}) takes vLLM's speculative_config keys; each is one field here
SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "model": "draft_model",
}


class ConfigError(PagedLLMError, ValueError):
    """An engine setting that cannot work; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _knob(default: Any, help: str, **cli: Any) -> Any:
    """A field with its command-line help (and, in ``cli``, argparse's ``choices``/``flag``/``type``)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _knob(
        None,
        "HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct); for plan, a config.json is enough",
        type=str,
    )
    dtype: str = _knob("float32", "weights and activations", choices=SUPPORTED_DTYPES, type=str)
    kv_cache_dtype: str | None = _knob(
        None,
        "KV cache dtype (default: as --dtype); int8 and fp8 (e4m3) keep one float32 scale per token and head",
        choices=KV_CACHE_DTYPES,
        type=str,
    )
    quantization: str | None = _knob(
        None,
        "weights: int8 / int4 quantize a float checkpoint at load; none dequantizes a GGUF's "
        "(default: as stored: a GGUF's quantized tensors run quantized)",
        choices=QUANTIZATIONS,
        type=str,
    )
    block_size: int = _knob(16, "tokens per KV cache block", type=int)
    num_blocks: int | None = _knob(None, "KV cache blocks", type=int)
    max_batch_tokens: int | None = _knob(None, "tokens computed per step", type=int)
    max_num_seqs: int | None = _knob(None, "sequences per step", type=int)
    max_model_len: int | None = _knob(None, "longest prompt + output", type=int)
    memory: str | int | None = _knob(
        None,
        "the whole engine's budget, e.g. 6GiB; follow: the container's limit (or the host's memory) "
        "less 5%%, tracked while it runs",
        type=str,
        exclusive="memory",
    )
    memory_fraction: float | None = _knob(
        None,
        "fraction of the memory free at start (default 0.9, cache capped at what max_num_seqs "
        "full-length requests can use)",
        type=float,
        exclusive="memory",
    )
    idle_release_after: float | None = _knob(
        None,
        "with no request for this many seconds, give the KV cache's free pages back to the OS "
        "(the prefix cache's too, unless --idle-keep-prefix-cache); the next request pays page faults",
        type=float,
        commands=("serve",),
    )
    idle_keep_prefix_cache: bool = _knob(
        False,
        "--idle-release-after: keep the prefix cache's blocks resident (moved to the bottom of the cache)",
        flag="--idle-keep-prefix-cache",
        commands=("serve",),
    )
    enable_prefix_caching: bool = _knob(
        True, "do not reuse the KV blocks of prompt prefixes seen before", flag="--no-prefix-caching"
    )
    prefix_cache_dir: str | None = _knob(
        None,
        "keep full KV blocks in this directory too (the prefix cache's disk tier): a prompt seen before, "
        "even by a process since stopped, is read back instead of computed (models of full attention only)",
        type=str,
    )
    prefix_cache_disk: str | int = _knob(
        "8GiB", "--prefix-cache-dir: the most its files take, e.g. 8GiB (least recently used deleted)", type=str
    )
    structured_output: bool = _knob(
        True, "reject constrained requests (and never load xgrammar)", flag="--no-structured-output"
    )
    backend: str = _knob(
        "auto",
        "what computes: cpu-compiled (C++ kernels), cpu-torch (plain PyTorch), auto (PAGEDLLM_KERNELS decides)",
        choices=BACKENDS,
        type=str,
    )
    threads: int | None = _knob(None, "torch threads (default: one per physical core, or PAGEDLLM_THREADS)", type=int)
    speculative_method: str | None = _knob(
        None,
        "speculative decoding: ngram (guesses from earlier n-grams of the prompt and output, "
        "verified in the same step; greedy and seeded output unchanged); draft_model (a smaller model's greedy "
        "guesses, --draft-model)",
        choices=SPECULATIVE_METHODS,
        type=str,
    )
    num_speculative_tokens: int = _knob(4, "speculative decoding: tokens guessed per step, at most", type=int)
    prompt_lookup_min: int = _knob(2, "ngram: the shortest suffix looked up", type=int)
    prompt_lookup_max: int = _knob(4, "ngram: the longest suffix looked up", type=int)
    draft_model: str | None = _knob(None, "draft_model: a smaller model of the same tokenizer", type=str)
    expert_slots: int | None = _knob(
        None,
        "a mixture of experts from a GGUF: keep at most this many routed experts resident and read the "
        "others from the file when chosen (default: all resident if they fit the budget, else as many as do)",
        type=int,
    )
    resident_layers: int | None = _knob(
        None,
        "a dense model from a GGUF: keep only this many decoder layers resident and read the others from the "
        "file every step (default: all resident if they fit the budget, else as many as do)",
        type=int,
    )
    state_checkpoints: int | None = _knob(
        None,
        "a model with recurrent layers (Qwen3.5, LFM2): prefix checkpoints of their state to keep, each as "
        "large as a sequence's state (default: one per running sequence, shed first when the budget shrinks; "
        "0: none, and no prefix reuse)",
        type=int,
    )
    tensor_parallel_size: int = _knob(
        1,
        "ranks the model is split over (tensor parallelism): plan sizes each rank; the engine runs 1 only (for now)",
        type=int,
        alias="-tp",
    )

    def __post_init__(self):
        """Every check in one place; names are normalised ('bf16' -> 'bfloat16')."""
        set_ = object.__setattr__
        set_(self, "dtype", _checked("dtype", self.dtype, dtype_name))
        if self.kv_cache_dtype is not None:
            set_(self, "kv_cache_dtype", _checked("kv_cache_dtype", self.kv_cache_dtype, kv_dtype_name))
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                "quantization", f"{self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)} (or None: as stored)"
            )
        if self.backend not in BACKENDS:
            hint = " (not implemented yet)" if str(self.backend).startswith("cuda") else ""
            raise ConfigError("backend", f"{self.backend!r}{hint}: choose one of {', '.join(BACKENDS)}")
        for name in (
            "block_size",
            "num_blocks",
            "max_batch_tokens",
            "max_num_seqs",
            "max_model_len",
            "threads",
            "expert_slots",
            "tensor_parallel_size",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be a whole number >= 1, got {value!r}")
        for name in ("resident_layers", "state_checkpoints"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(name, f"must be a whole number >= 0, got {value!r}")
        if self.memory is not None and self.memory_fraction is not None:
            raise ConfigError("memory", "give memory or memory_fraction, not both")
        if self.memory is not None and self.memory != "follow":
            _checked("memory", self.memory, parse_memory)
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError("memory_fraction", f"must be in (0, 1], got {self.memory_fraction}")
        self._check_speculative()
        _checked("prefix_cache_disk", self.prefix_cache_disk, parse_memory)
        if self.prefix_cache_dir is not None and not self.enable_prefix_caching:
            raise ConfigError("prefix_cache_dir", "the prefix cache's disk tier needs prefix caching on")
        if self.prefix_cache_dir is not None and self.tensor_parallel_size > 1:
            raise ConfigError("prefix_cache_dir", "the disk tier with tensor_parallel_size > 1 is not implemented yet")
        if self.idle_release_after is not None and not self.idle_release_after >= 0:
            raise ConfigError("idle_release_after", f"must be seconds >= 0, got {self.idle_release_after}")

    def _check_speculative(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ConfigError("speculative_method", f"{method!r}: choose one of {', '.join(SPECULATIVE_METHODS)}")
        if method == "draft_model" and not self.draft_model:
            raise ConfigError("draft_model", "speculative_method='draft_model' needs the draft model's path")
        if method == "draft_model" and self.tensor_parallel_size > 1:
            raise ConfigError("draft_model", "a draft model with tensor_parallel_size > 1 is not implemented yet")
        if method == "draft_model" and self.memory == "follow":
            raise ConfigError("draft_model", "a draft model with memory='follow' is not implemented yet")
        if self.draft_model is not None and method != "draft_model":
            raise ConfigError("draft_model", "a draft model needs speculative_method='draft_model'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                "prompt_lookup_min", f"{self.prompt_lookup_min} is above prompt_lookup_max {self.prompt_lookup_max}"
            )

    @property
    def budgeted(self) -> bool:
        """A memory budget was given: the engine commits its cache at once and measures itself."""
        return self.memory is not None or self.memory_fraction is not None

    @classmethod
    def from_options(cls, model: Any = None, **options: Any) -> EngineConfig:
        """From ``LLM(model, **options)``; an unknown option is a TypeError naming the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        speculative = options.pop("speculative", None)
        if speculative is not None:
            options.update(_speculative_fields(speculative))
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model=None if model is None else str(model), **options)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From the flags ``add_flags`` made (a field a command has no flag for keeps its default)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _speculative_fields(speculative: Any) -> dict[str, Any]:
    """``speculative={"method": "ngram", "num_speculative_tokens": 4, ...}`` (vLLM's keys) as fields."""
    if not isinstance(speculative, dict):
        raise ConfigError("speculative", f"a dict of {', '.join(SPECULATIVE_KEYS)}, got {speculative!r}")
    unknown = sorted(set(speculative) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ConfigError("speculative", f"unknown key(s) {', '.join(unknown)}; known: {', '.join(SPECULATIVE_KEYS)}")
    if "method" not in speculative:
        raise ConfigError("speculative", "give its 'method' ('ngram' or 'draft_model')")
    return {SPECULATIVE_KEYS[key]: value for key, value in speculative.items()}


def add_flags(parser: argparse.ArgumentParser, command: str | None = None) -> None:
    """The command-line flags of the EngineConfig fields, in the 'model and engine' group: every
    field's, but those a field keeps for some commands (``commands=``) only on those."""
    group = parser.add_argument_group("model and engine")
    exclusive: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        meta = dict(f.metadata)
        if command not in meta.pop("commands", (command,)):
            continue
        target = group
        if "exclusive" in meta:
            name = meta.pop("exclusive")
            if name not in exclusive:  # (one group per name: an empty one breaks --help)
                exclusive[name] = group.add_mutually_exclusive_group()
            target = exclusive[name]
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"  # the flag turns the default around
            target.add_argument(meta["flag"], dest=f.name, action=action, help=meta["help"])
            continue
        flags = ["--" + f.name.replace("_", "-")] + ([meta["alias"]] if "alias" in meta else [])
        kwargs: dict[str, Any] = {"choices": list(meta["choices"])} if "choices" in meta else {}
        target.add_argument(*flags, dest=f.name, default=f.default, type=meta["type"], help=meta["help"], **kwargs)


def _checked(name: str, value: Any, parse) -> Any:
    try:
        return parse(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(name, str(e)) from None
