"""The measured-vs-predicted grid: real engine steps of many shapes, each measured with
``track_peak`` and predicted with ``memory.footprint.step_phases``. The tests check it within
10%; run as a script, it prints the table in docs/memory.md:

    .venv/bin/python tests/memory_grid.py [--model PATH] [--dtype float32 bfloat16]

ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (or AVX512_CORE, AVX2) runs it as a machine without AMX
(without bf16 instructions, without AVX-512) would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.backends.cpu.onednn_probe import dispatched_gemm_isa
from pagedllm.backends.cpu.workspace import DEQUANT_CHUNK_ELEMENTS, QUANT_FLOAT_ANY_ROWS, padded_rows, tile_packable
from pagedllm.engine import LLMEngine
from pagedllm.layers.linear import Linear
from pagedllm.memory.footprint import SCALAR_SLACK, EngineSettings, step_phases
from pagedllm.memory.tracker import track_peak
from pagedllm.sampling_params import SamplingParams
from pagedllm.sizes import ceil_div

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# The sampler's costliest path: a nucleus too wide for its candidates (a flat distribution, no
# top-k), which sorts the vocabulary (layers/sampler.py); the footprint bounds every row by it.
FULL = SamplingParams(
    max_tokens=4,
    temperature=4.0,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    logprobs=2,
    ignore_eos=True,
)
PROMPT_LOGPROBS = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=5, ignore_eos=True)
EMBEDDING = SamplingParams(max_tokens=1, pooling="mean")


@dataclass
class GridPoint:
    name: str
    tokens: int
    sampled: int
    measured: int
    predicted: int
    peak_phase: str
    scratch_bound: int = 0  # where the bf16 GEMM scratch is a bound, not a fit: by how much (_gemm_slack)

    @property
    def ratio(self) -> float:
        return self.predicted / max(self.measured, 1)


def scenarios(max_len: int):
    """(name, prompt lengths, params, steps before the measured one, engine sizes)."""
    long = min(2000, max_len - 8)
    return [
        ("prefill 1x16", [16], GREEDY, 0, dict(max_batch_tokens=512)),
        ("prefill 1x(M=512)", [min(512, max_len - 8)], GREEDY, 0, dict(max_batch_tokens=512)),
        ("prefill 8x64", [64] * 8, GREEDY, 0, dict(max_batch_tokens=512)),
        ("decode 1", [30], GREEDY, 1, dict(max_batch_tokens=512)),
        ("decode 64", [16 + i for i in range(64)], GREEDY, 1, dict(max_batch_tokens=8192)),
        ("decode 64, full sampling", [16 + i for i in range(64)], FULL, 1, dict(max_batch_tokens=8192)),
        ("chunked prefill 2nd chunk", [min(700, max_len - 8)], GREEDY, 1, dict(max_batch_tokens=256)),
        ("long context, last chunk", [long], GREEDY, (long - 1) // 128, dict(max_batch_tokens=128)),
        ("mixed decode + prefill", [50] * 10 + [300], GREEDY, 1, dict(max_batch_tokens=600)),
        ("M=32 small steps", [200] * 3, GREEDY, 2, dict(max_batch_tokens=32)),
        # a logits row per prompt position, up to max_num_seqs a step (what the plan counts)
        ("prompt logprobs 4x200", [200] * 4, PROMPT_LOGPROBS, 0, dict(max_batch_tokens=1024, max_num_seqs=64)),
        ("embeddings, mean 4x200", [200] * 4, EMBEDDING, 0, dict(max_batch_tokens=1024)),
    ]


def run_grid(loaded, dtype: str, seed: int = 0, kv_dtype: str | None = None) -> list[GridPoint]:
    cfg = loaded.config
    g = torch.Generator().manual_seed(seed)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    packed = any(isinstance(m, Linear) and m.packed for m in loaded.model.modules())
    kernels = loaded.model.backend.kernels
    settings = EngineSettings(
        dtype=dtype,
        gemm_isa=dispatched_gemm_isa(),  # oneDNN's own word on what its bf16 GEMMs run on
        threads=torch.get_num_threads(),
        kernels=kernels,
        packed=packed,
        quantized_weights=loaded.model.quantized(),
        # w8a8's GEMMs hold other transients than weight-only quantization's
        quantization="w8a8" if any(getattr(m, "int8_activations", False) for m in loaded.model.modules()) else None,
        amx_tiles=getattr(loaded.model.backend, "amx_tiles", False),
        quant_float_max_rows=getattr(loaded.model.backend, "quant_float_max_rows", QUANT_FLOAT_ANY_ROWS),
        own_int8_sums=getattr(loaded.model.backend, "own_int8_sums", False),
        kv_dtype=kv_dtype,
    )
    warm = LLMEngine.of(loaded, num_blocks=64, max_model_len=256, kv_cache_dtype=kv_dtype)
    warm.threads.adapt = False
    warm.add_request(prompt(20), FULL)
    warm.step(), warm.step()  # first-use initialisation stays out of the measurements
    points = []
    for name, lengths, params, before, sizes in scenarios(cfg.max_position_embeddings):
        engine = LLMEngine.of(loaded, num_blocks=2048, kv_cache_dtype=kv_dtype, **sizes)
        engine.threads.adapt = False  # predicted for settings.threads: a busy host must not change it
        engine.record_step_shapes = True
        for n in lengths:
            engine.add_request(prompt(n), params)
        for _ in range(before):
            engine.step()
        with track_peak() as m:
            engine.step()
        phases = step_phases(cfg, settings, engine.last_step_shape)
        top = max(phases, key=phases.get)
        shape = engine.last_step_shape
        slack = _gemm_slack(cfg, settings, shape, loaded.model.backend)
        points.append(GridPoint(name, shape.tokens, shape.sampled, m.peak_bytes, phases[top], top, slack))
    return points


def check_grid(loaded, dtype: str, kv_dtype: str | None = None) -> None:
    """The planner's promise: every step's measured peak is within its prediction, and the
    prediction within 10% of it."""
    points = run_grid(loaded, dtype, kv_dtype=kv_dtype)
    report = "\n".join(
        f"{p.name:28s} T={p.tokens:5d} S={p.sampled:3d} measured {p.measured:>10d} "
        f"predicted {p.predicted:>10d} x{p.ratio:.3f} ({p.peak_phase})"
        for p in points
    )
    print(report)
    for p in points:
        # SCALAR_SLACK: the model's constant for one-element temporaries, more than 10% of the
        # smallest steps (2 KB: one bf16 decode row of a tiny model where GEMMs take no scratch)
        assert p.measured <= p.predicted <= 1.10 * p.measured + SCALAR_SLACK + p.scratch_bound, report


def check_grids(grids: list[tuple[str, str | None, str | None]]) -> None:
    """``check_grid`` in bf16 for each (checkpoint path, quantization, KV dtype)."""
    from pagedllm import loading

    for path, quantization, kv_dtype in grids:
        check_grid(loading.load(path, "bfloat16", quantization=quantization), "bfloat16", kv_dtype)


def _gemm_slack(cfg, s: EngineSettings, shape, backend) -> int:
    """How far the predicted GEMM scratch may exceed oneDNN's, where ``gemm_scratch`` is a bound:
    on AMX, the whole scratch of the step's costliest GEMM as measured here, each of its GEMMs
    run alone (oneDNN picks among kernels by shape; the planner's bound is not asked, so a bound
    too large fails instead of widening its own allowance);
    on AVX512-BF16, half a thread's accumulator block, which oneDNN leaves out when the output's
    64-column blocks do not divide among the threads and it splits the rows instead (measured:
    docs/memory.md). Elsewhere the scratch is exact: none."""
    if s.dtype != "bfloat16" or s.gemm_isa not in ("amx", "avx512_bf16"):
        return 0
    h, i, dq = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    t, n = shape.tokens, shape.sampled
    packed_head = s.packed and not cfg.tie_word_embeddings  # a tied lm_head stays plain
    dk = cfg.num_kv_heads * cfg.head_dim
    shapes = [(t, h, dq + 2 * dk, s.packed), (t, dq, h, s.packed), (t, h, 2 * i, s.packed), (t, i, h, s.packed)]
    shapes.append((n, h, cfg.vocab_size, packed_head))
    # The compiled kernels' own packed GEMM (AMX tiles) has no oneDNN scratch to bound: exact.
    ours = s.amx_tiles and s.kernels == "compiled" and not s.quantized_weights
    shapes = [(r, k, out, packed) for r, k, out, packed in shapes if not (ours and packed and tile_packable(out, k))]
    if s.packed:  # prepacked oneDNN GEMMs run on padded rows
        shapes = [(padded_rows(r) if packed else r, k, out, packed) for r, k, out, packed in shapes]
    if s.quantized_weights and s.amx_tiles:
        return 0
    if s.quantized_weights:  # plain GEMMs on dequantized chunks
        shapes = [(r, k, min(out, DEQUANT_CHUNK_ELEMENTS // k), False) for r, k, out, _ in shapes]
    if s.gemm_isa == "amx":
        return max((measured_gemm_scratch(backend, r, k, out, packed) for r, k, out, packed in shapes), default=0)
    uneven = [r for r, _, out, _ in shapes if s.threads > 1 and ceil_div(out, 64) % s.threads]
    return max((s.threads * 128 * min(r, 256) for r in uneven), default=0)


_MEASURED_SCRATCH: dict[tuple, int] = {}


def measured_gemm_scratch(backend, rows: int, k: int, n: int, packed: bool) -> int:
    """The tensor memory one bf16 GEMM of this shape holds beyond its output, run alone through
    the backend as the model runs it (packed weights if ``packed``), after a first call that
    builds its kernel."""
    key = (rows, k, n, packed, torch.get_num_threads())
    if key not in _MEASURED_SCRATCH:
        g = torch.Generator().manual_seed(0)
        plain = torch.randn(n, k, generator=g).bfloat16()
        weight = backend.pack_weight(plain, None) if packed else None
        weight, packed = (plain, False) if weight is None else (weight, True)
        x = torch.randn(rows, k, generator=g).bfloat16()
        backend.linear(x, weight, None, packed)
        with track_peak() as m:
            y = backend.linear(x, weight, None, packed)
        _MEASURED_SCRATCH[key] = max(0, m.peak_bytes - y.numel() * y.element_size())
    return _MEASURED_SCRATCH[key]


def main() -> None:
    import argparse

    from pagedllm import loading

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    print(f"GEMM kernels: {dispatched_gemm_isa()} (oneDNN's report), {torch.get_num_threads()} threads")
    print("| dtype | step | tokens | sampled | measured | predicted | predicted / measured | peak phase |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for dtype in args.dtype:
        for p in run_grid(loading.load(args.model, dtype), dtype):
            print(
                f"| {dtype} | {p.name} | {p.tokens} | {p.sampled} | {p.measured / 2**20:.3f} MiB | "
                f"{p.predicted / 2**20:.3f} MiB | {p.ratio:.3f} | {p.peak_phase} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
