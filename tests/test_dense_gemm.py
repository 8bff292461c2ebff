"""The compiled kernels' own bf16 GEMM (kernels/csrc/dense_gemm.cpp), which runs a bf16 model's
linear layers where AMX tiles are granted: against float64 arithmetic on the same bf16 values
(one rounding to bf16, nothing more), on both of its paths (AMX tiles from two rows, dot products
for one row, and for every row count in a process whose oneDNN cap forbids AMX), with and
without bias; the memory it takes from torch's allocator (its output, as the planner counts);
and the backend packing for it only where the tiles are granted."""

import pytest
import torch
from kernel_paths import run_with_amx_capped

from pagedllm.backends.cpu.compiled_backend import CPUCompiledBackend

# (output channels, input columns): the default model's q/k/v, down and a small one
SHAPES = [(960, 576), (576, 1536), (48, 64)]
ROWS = [1, 2, 7, 16, 17, 33, 70]


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y + bias.double() if bias is not None else y


def assert_dense_linear_matches(ops, rows_list=ROWS) -> int:
    """Every shape x rows x bias case; returns how many ran. The bound: half a bf16 step of the
    exact result (its one rounding) plus float32 summation error (K * 2^-24 of sum |x w|)."""
    backend = CPUCompiledBackend(ops)
    backend.amx_tiles = True  # pack for the kernel even where this process would not use it
    g = torch.Generator().manual_seed(0)
    cases = 0
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=g).bfloat16()
        packed = backend.pack_weight(weight, None)
        assert packed.shape == (n // 16, k // 32, 16, 32)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g).bfloat16()
            for bias in (None, torch.randn(n, generator=g).bfloat16()):
                got = backend.linear(x, packed, bias, True)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                want = exact(x, weight, bias)
                magnitude = x.double().abs() @ weight.double().abs().T
                bound = 2.0**-8 * want.abs() + k * 2.0**-24 * magnitude
                err = (got.double() - want).abs()
                assert bool((err <= bound).all()), ((n, k, rows, bias is not None), float((err - bound).max()))
                # the one rounding: nearly every value is the exact result rounded to bf16
                assert (got == want.bfloat16()).float().mean() > 0.99, (n, k, rows)
                cases += 1
    return cases


def test_dense_linear_matches_exact_arithmetic(ops):
    if not ops.amx_tiles():
        pytest.skip("no AMX tiles here: the backend never packs for this kernel (the next test runs its dot path)")
    assert assert_dense_linear_matches(ops) == len(SHAPES) * len(ROWS) * 2


def test_dense_linear_dot_path_without_amx_matches_exact_arithmetic(ops):
    """With AMX capped away every row count runs the AVX512-BF16 dot products, and the backend
    keeps oneDNN's packing (faster than those dot products at prefill sizes)."""
    script = (
        "import json, torch\n"
        "from pagedllm.kernels import compiled_ops\n"
        "from pagedllm.backends.cpu.compiled_backend import CPUCompiledBackend\n"
        "from test_dense_gemm import assert_dense_linear_matches\n"
        "ops = compiled_ops()\n"
        "assert not ops.amx_tiles()\n"
        "backend = CPUCompiledBackend(ops)\n"
        "packed = backend.pack_weight(torch.randn(64, 64).bfloat16(), None)\n"
        "assert packed is None or packed.dim() == 2, 'packed for the tiles without them'\n"
        "try:\n"
        "    print(json.dumps(assert_dense_linear_matches(ops, [1, 3, 8, 9, 17])))\n"
        "except RuntimeError as e:\n"
        "    if 'AVX512-BF16' not in str(e): raise\n"
        "    print(json.dumps('not built'))\n"
    )
    ran = run_with_amx_capped(script)
    if ran == "not built":
        pytest.skip("kernels built without AVX512-BF16: the op raises, the backend keeps oneDNN")
    assert ran == len(SHAPES) * 5 * 2


@pytest.mark.serial  # measured peak
def test_dense_linear_takes_only_its_output_from_torch(ops):
    """What memory.footprint counts for these GEMMs: the output tensor; the padded copy of a
    partial row tile is the kernels' own (kernel_scratch_bytes)."""
    from pagedllm.memory.tracker import track_peak

    if not ops.amx_tiles():
        pytest.skip("no AMX tiles here: the backend never packs for this kernel")
    backend = CPUCompiledBackend(ops)
    weight = torch.randn(576, 1536).bfloat16()
    packed = backend.pack_weight(weight, None)
    for rows in (1, 9, 208):
        x = torch.randn(rows, 1536).bfloat16()
        backend.linear(x, packed, None, True)
        with track_peak() as m:
            backend.linear(x, packed, None, True)
        assert m.peak_bytes == rows * 576 * 2, rows


def test_dense_linear_rejects_what_it_cannot_multiply(ops):
    packed = torch.zeros(2, 1, 16, 32, dtype=torch.bfloat16)
    try:
        ops.dense_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, None)
    except RuntimeError as e:
        if "AVX512-BF16" in str(e):
            pytest.skip("kernels built without AVX512-BF16")
        raise
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.dense_linear(torch.zeros(1, 64, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.dense_linear(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(32, 32, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.dense_linear(torch.zeros(1, 32, dtype=torch.bfloat16), packed, torch.zeros(31, dtype=torch.bfloat16))
