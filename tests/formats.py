"""The ways to run the default model that the quality table and tests judge, the rule each must
keep, and the reference they are judged against: transformers' float32 reading of the same GGUF.
(Shared by tests/test_quality.py and benchmarks/quality.py.)"""

from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from greedy import Precision
from safetensors.torch import save_file

from pagedllm.loading.default_model import default_gguf_path
from pagedllm.loading.gguf_cache import converted_dir

FLOAT_COPY = "float32 copy"  # the model as float32 safetensors (see ``float_copy``)

# name, model (None: the embedded default, as LLM() loads it), LLM(...) keyword arguments
CONFIGS: list[tuple[str, str | None, dict]] = [
    ("fp32", None, dict(dtype="float32", quantization="none")),  # the reference: keep it first
    ("bf16", None, dict(dtype="bfloat16", quantization="none")),
    ("int8", FLOAT_COPY, dict(dtype="float32", quantization="int8")),
    ("int4", FLOAT_COPY, dict(dtype="float32", quantization="int4")),
    # int8 weights and activations (the GGUF's tensors dequantized and quantized again at load)
    ("w8a8", None, dict(dtype="float32", quantization="w8a8")),
    ("gguf-q4_1", None, dict(dtype="float32")),  # the GGUF's Q4_1 / Q8_0 tensors kept as stored
    ("gguf-q4_1 bf16", None, dict(dtype="bfloat16")),
    # one sequence at a time: decode steps of one row take the packed-weight kernel (in bf16:
    # activations in 8 bits per 32 columns); batches of more than 8 rows dequantize + GEMM
    ("gguf-q4_1 bf16, 1 seq", None, dict(dtype="bfloat16", max_num_seqs=1)),
    ("kv-int8", None, dict(dtype="float32", quantization="none", kv_cache_dtype="int8")),
    ("kv-fp8", None, dict(dtype="float32", quantization="none", kv_cache_dtype="fp8")),
]


@dataclass(frozen=True)
class FormatRule:
    """What one way of running the default model (a weight format, a KV-cache format) must keep
    against transformers' float32 reading of the same weights: the per-step rule at
    ``precision``, and perplexity on tests/data/quality_text.txt within ``max_perplexity_ratio``
    of the float32 model's."""

    precision: Precision
    max_perplexity_ratio: float


# Tolerances: 1.5x each format's logit error measured on the text's first 512 tokens (bf16 3.2%,
# int8 6.3%, int4 2.9%: requantizing Q4_1's weights to int4 is nearly exact, 8-bit KV 5.7%, fp8 KV
# 13.5%), room for other texts. Perplexity bounds, what each format is allowed to cost: float32 on
# the same weights nothing (1e-4: summation order); bf16 keeps 8 bits of mantissa, 0.5%; 8 bits
# per weight or cached value (a 1/254 step at the row's largest), 2%; 4-bit weights and fp8's 3
# mantissa bits, 5%. Floors of exact steps: 90% for every rounding format (measured 96-99%), 85% for
# fp8 (the coarsest), 99% for float32 over the same weights.
_FLOAT32 = FormatRule(Precision(logit_tolerance=1e-4, min_exact_steps=0.99), max_perplexity_ratio=1.0001)
_BF16 = FormatRule(Precision(logit_tolerance=0.05, min_exact_steps=0.9), max_perplexity_ratio=1.005)
FORMAT_RULES: dict[str, FormatRule] = {
    "fp32": _FLOAT32,
    "bf16": _BF16,
    "int8": FormatRule(Precision(logit_tolerance=0.10, min_exact_steps=0.9), max_perplexity_ratio=1.02),
    # int4: Q4_K blocks where a width is whole blocks of 256 (the default model's down_proj), else
    # Q4_1's layout. Measured Dec 6: logit error 7.0%, perplexity 1.0078, exact steps 96.9%. The
    # tolerance was 5% while int4 was Q4_1's layout everywhere: on this model, itself Q4_1, that
    # layout finds each group's grid again (error 2.9%, as low as bf16's), which 6-bit sub-scales
    # cannot; 1.5x the measured 7.0%, as for every other row
    "int4": FormatRule(Precision(logit_tolerance=0.11, min_exact_steps=0.9), max_perplexity_ratio=1.05),
    # w8a8: measured logit error 17%, perplexity 1.0437, exact steps 91%: the bound guards what it
    # costs today; issue 31's target (within 1.5% of fp32) is NOT met (docs/quantization.md)
    "w8a8": FormatRule(Precision(logit_tolerance=0.26, min_exact_steps=0.85), max_perplexity_ratio=1.05),
    "gguf-q4_1": _FLOAT32,
    "gguf-q4_1 bf16": _BF16,
    "gguf-q4_1 bf16, 1 seq": _BF16,
    "kv-int8": FormatRule(Precision(logit_tolerance=0.09, min_exact_steps=0.9), max_perplexity_ratio=1.02),
    "kv-fp8": FormatRule(Precision(logit_tolerance=0.20, min_exact_steps=0.85), max_perplexity_ratio=1.05),
}


@functools.cache
def hf_model():
    """transformers' float32 model of the embedded GGUF, read once per process (reading the GGUF
    takes transformers 10-20 s on 2 cores); its callers only run it, never change it."""
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def float_copy() -> Path:
    """The default model as an HF directory of float32 safetensors, built once: transformers'
    weights of the GGUF, the config and tokenizer of pagedllm's converted directory.
    (transformers' ``save_pretrained`` refuses a model read from a GGUF, so the state dict is
    written directly; a tied lm_head is the embeddings and is left out.)"""
    converted = converted_dir(default_gguf_path())
    target = Path(tempfile.gettempdir()) / "pagedllm-quality" / f"{converted.name}-float32"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model = hf_model()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        for f in converted.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, tmp / f.name)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
