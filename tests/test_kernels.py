"""The compiled CPU kernels against the pure-PyTorch path they replace, and both against
attention written in float64 from its definition (each row within a few of the dtype's eps of
the terms it sums): the same cache contents, 8-bit rows within half a step of the values
written, on every shape the engine produces (decode rows, prefill chunks over a
cached context, sliding windows, every GQA ratio, head sizes 64 and 128, fp32 and bf16, 8-bit
caches; bf16 prefill tiles on AMX and, with AMX capped away, on AVX-512), and clear errors for
tables that point outside the cache."""

import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from kernel_paths import compiled_backend, run_with_amx_capped, torch_backend

from pagedllm.backends.cpu.attention import SequenceSlice, StepLayout
from pagedllm.backends.cpu.kv_cache import KVCache


def random_cache(kv_heads, num_blocks, block_size, d, dtype, seed):
    """A one-layer KV cache full of random (finite) values, as stale blocks would be."""
    cfg = SimpleNamespace(num_kv_heads=kv_heads, head_dim=d, num_layers=1)
    cache = KVCache(cfg, num_blocks, block_size, dtype)
    g = torch.Generator().manual_seed(seed)
    for values, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        fresh = torch.randn(values[0].shape, generator=g)
        if cache.quantized:
            values[0].view(torch.uint8).copy_((fresh * 40).clamp(-127, 127).to(cache.dtype).view(torch.uint8))
            scales[0].copy_(torch.rand(scales[0].shape, generator=g) / 40)
        else:
            values[0].copy_(fresh.to(cache.dtype))
    return cache


def clone(cache):
    other = object.__new__(KVCache)
    other.__dict__.update(cache.__dict__)
    for name in ("k", "v", "k_scale", "v_scale"):
        setattr(other, name, [t.clone() for t in getattr(cache, name)])
    return other


# (query rows, context) per sequence: decodes, prefill chunks starting at 0, chunks over a
# cached context (prefix hit or chunked prefill), one context longer than a query tile.
STEP = [(1, 37), (1, 1), (20, 20), (7, 50), (1, 100), (33, 140), (1, 16), (40, 300)]


def run_both_paths(dtype, cache_dtype, heads, kv_heads, window, d=64, rows_and_contexts=STEP):
    """(compiled output, torch output, compiled cache, torch cache, the step) for the step
    ``rows_and_contexts`` (STEP unless given)."""
    bs, num_blocks = 16, 64
    cache = random_cache(kv_heads, num_blocks, bs, d, cache_dtype, seed=heads * 10 + kv_heads)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)  # block tables out of order, as after frees
    slices, t = [], 0
    for q_len, ctx in rows_and_contexts:
        slices.append(SequenceSlice(t, q_len, ctx, [free.pop() for _ in range(-(-ctx // bs))]))
        t += q_len
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)  # views, as the model passes them
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    layout = StepLayout.from_slices(slices, bs, heads // kv_heads)
    expected_cache = clone(cache)
    expected = torch_backend().attention(expected_cache, layout).attend(0, q, k, v, d**-0.5, window)
    got = compiled_backend().attention(cache, layout).attend(0, q, k, v, d**-0.5, window)
    step = SimpleNamespace(slices=slices, q=q, k=k, v=v, window=window, block_size=bs)
    return got, expected, cache, expected_cache, step


def cached_values(cache, name: str) -> torch.Tensor:
    """[KVH, slots, D] float64: what the cache holds, dequantized by the test's own arithmetic."""
    values = getattr(cache, name)[0].to(torch.float64)
    if cache.quantized:
        values = values * getattr(cache, f"{name}_scale")[0].to(torch.float64)[..., None]
    return values


def slots_of(sl, block_size: int) -> torch.Tensor:
    """The cache slots of a slice's positions 0 .. context - 1."""
    positions = torch.arange(sl.context_len)
    return torch.tensor(sl.block_table)[positions // block_size] * block_size + positions % block_size


def oracle_attention(cache, step, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written from its definition in float64 over what the cache holds after the step:
    each query row attends to its sequence's positions up to its own (within the sliding window).
    Returns the output [T, H, D] and, per row, sum_j p_j |v_j| (the scale its rounding error
    is judged against: a row that cancels to near zero still sums terms that large)."""
    keys, values = cached_values(cache, "k"), cached_values(cache, "v")
    group = heads // keys.shape[0]
    out = torch.zeros(step.q.shape, dtype=torch.float64)
    magnitude = torch.zeros(step.q.shape, dtype=torch.float64)
    for sl in step.slices:
        slots = slots_of(sl, step.block_size)
        kh = keys[:, slots].repeat_interleave(group, dim=0)  # [H, context, D]
        vh = values[:, slots].repeat_interleave(group, dim=0)
        rows = slice(sl.query_start, sl.query_start + sl.query_len)
        q = step.q[rows].to(torch.float64).transpose(0, 1)  # [H, query, D]
        positions = torch.arange(sl.context_len - sl.query_len, sl.context_len)[:, None]
        allowed = torch.arange(sl.context_len)[None, :] <= positions
        if step.window is not None:
            allowed &= torch.arange(sl.context_len)[None, :] > positions - step.window
        scores = (q @ kh.transpose(1, 2)) * q.shape[-1] ** -0.5
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[rows] = (p @ vh).transpose(0, 1)
        magnitude[rows] = (p @ vh.abs()).transpose(0, 1)
    return out, magnitude


def rounding_error_in_eps(got, cache, step, heads) -> float:
    """The largest row error against the oracle, in units of the output dtype's epsilon relative
    to the row's sum_j p_j |v_j|."""
    expected, magnitude = oracle_attention(cache, step, heads)
    error = (got.to(torch.float64) - expected).norm(dim=-1) / magnitude.norm(dim=-1)
    return float(error.max()) / torch.finfo(got.dtype).eps


# Measured (in the output dtype's eps, relative to sum_j p_j |v_j|): float32 up to 4.6 on both
# paths, bf16 up to 0.8 (the output's one rounding; P in bf16 on the PyTorch path), and 2.6 on the
# PyTorch path over an fp8 cache (it rounds the dequantized K/V to bf16 before the dot products).
# An error of 10% is 13 bf16 eps.
ATTENTION_EPS = {torch.float32: 8.0, torch.bfloat16: 4.0}


def assert_attention_matches(dtype, heads, kv_heads, window, d):
    got, expected, cache, expected_cache, step = run_both_paths(dtype, dtype, heads, kv_heads, window, d)
    assert torch.equal(cache.k[0], expected_cache.k[0]) and torch.equal(cache.v[0], expected_cache.v[0])
    for out in (got, expected):
        assert rounding_error_in_eps(out, cache, step, heads) <= ATTENTION_EPS[dtype]


ATTENTION_CASES = [
    (heads, kv_heads, window, d)
    for heads, kv_heads in [(9, 3), (8, 8), (8, 1), (4, 2)]
    for window in [None, 5, 40]
    for d in [64, 128]
]
# Gemma 3's head_dim, and one that no path specializes
ATTENTION_CASES += [(4, 1, None, 256), (4, 1, 5, 256), (8, 2, 40, 256), (9, 3, None, 96)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, window, d", ATTENTION_CASES)
def test_paged_attention_matches_the_torch_path(ops, dtype, heads, kv_heads, window, d):
    assert_attention_matches(dtype, heads, kv_heads, window, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, window, d", [(4, 1, None, 256), (4, 1, 5, 64), (6, 2, None, 128)])
def test_a_lone_decode_row_split_among_threads_is_the_row_decoded_among_others(ops, dtype, heads, kv_heads, window, d):
    """One request decoding has fewer KV heads than threads (Gemma 3 270M: one): its query heads
    are split among the threads. The row must match the float64 oracle and be, to the bit, the
    row it is when other requests share the step (and nothing is split)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = run_both_paths(dtype, dtype, heads, kv_heads, window, d, [(1, 100)])
        among = run_both_paths(dtype, dtype, heads, kv_heads, window, d, [(1, 100), (1, 37), (1, 50)])
    finally:
        torch.set_num_threads(saved)
    got, _, cache, _, step = alone
    assert rounding_error_in_eps(got, cache, step, heads) <= ATTENTION_EPS[dtype]
    assert torch.equal(got[0], among[0][0])


def test_bf16_attention_without_amx_tiles_matches_the_torch_path(ops):
    """On a CPU with AMX the test above runs bf16 prefill tiles on AMX; here the same cases run
    in a process whose oneDNN cap forbids AMX, so the AVX-512 loops a CPU without it takes are
    checked on this machine too."""
    if not ops.amx_tiles():
        pytest.skip("no AMX tiles here: the test above already ran the AVX-512 path")
    script = (
        "import json, torch\n"
        "from pagedllm.kernels import compiled_ops\n"
        "from test_kernels import ATTENTION_CASES, assert_attention_matches\n"
        "assert not compiled_ops().amx_tiles()\n"
        "for case in ATTENTION_CASES: assert_attention_matches(torch.bfloat16, *case)\n"
        "print(json.dumps(len(ATTENTION_CASES)))"
    )
    assert run_with_amx_capped(script) == len(ATTENTION_CASES)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, window", [(9, 3, None), (8, 1, 40)])
def test_8bit_cache_matches_the_torch_path(ops, cache_dtype, dtype, heads, kv_heads, window):
    """Both paths store the same bytes and scales (quantizing in the same order) and attend to
    the same dequantized values."""
    got, expected, cache, expected_cache, step = run_both_paths(dtype, cache_dtype, heads, kv_heads, window)
    for name in ("k", "v", "k_scale", "v_scale"):
        mine, theirs = getattr(cache, name)[0], getattr(expected_cache, name)[0]
        changed = (
            (mine.view(torch.uint8) != theirs.view(torch.uint8)) if mine.dtype != torch.float32 else mine != theirs
        )
        # a value on a rounding boundary may round either way (the kernel multiplies by 1/scale in fp32 too)
        assert changed.float().mean() < 1e-3, name
    # the step's rows as stored: within half a step of the values written (the test's arithmetic:
    # int8 steps of absmax / 127; fp8 e4m3 keeps 3 mantissa bits, and its subnormals step by 2^-9
    # of the scale)
    for sl in step.slices:
        new = slots_of(sl, step.block_size)[sl.context_len - sl.query_len :]
        for name, written in (("k", step.k), ("v", step.v)):
            stored = cached_values(cache, name)[:, new].transpose(0, 1)
            x = written[sl.query_start : sl.query_start + sl.query_len].to(torch.float64)
            amax = x.abs().amax(dim=-1, keepdim=True)
            if cache_dtype == "int8":
                bound = amax / 127 / 2
            else:
                bound = x.abs() * 2.0**-4 + amax / 448 * 2.0**-10
            assert ((stored - x).abs() <= bound * (1 + 1e-5) + 1e-12).all(), name
    # bf16: the PyTorch path rounds dequantized K/V to bf16, the kernel keeps them in fp32
    for out in (got, expected):
        assert rounding_error_in_eps(out, cache, step, heads) <= ATTENTION_EPS[dtype]


def test_paged_attention_rejects_tables_outside_the_cache(ops):
    cache = random_cache(2, 4, 16, 32, torch.float32, seed=0)
    q, k = torch.randn(1, 4, 32), torch.randn(1, 2, 32)
    args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not in the cache"):
        ops.paged_attention(
            q, k, k, cache.k[0], cache.v[0], *args, torch.tensor([[0, 9]], dtype=torch.int32), 16, 1.0, 0, 1 << 18
        )
    with pytest.raises(RuntimeError, match="block table too short"):
        ops.paged_attention(
            q, k, k, cache.k[0], cache.v[0], *args, torch.tensor([[0]], dtype=torch.int32), 16, 1.0, 0, 1 << 18
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_kernels_match_the_torch_path(ops, dtype):
    g = torch.Generator().manual_seed(0)
    rows, h = 37, 576
    x = torch.randn(rows, h, generator=g).to(dtype)
    residual = torch.randn(rows, h, generator=g).to(dtype)
    weight = torch.rand(h, generator=g).to(dtype) + 0.5
    exact = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    compiled, reference = compiled_backend(), torch_backend()

    torch.testing.assert_close(compiled.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **exact)

    r1, r2 = residual.clone(), residual.clone()
    got, want = compiled.add_rms_norm(r1, x, weight, 1e-5), reference.add_rms_norm(r2, x, weight, 1e-5)
    torch.testing.assert_close(got, want, **exact)
    assert torch.equal(r1, r2)

    gate_up = torch.randn(rows, 2 * 96, generator=g).to(dtype)
    torch.testing.assert_close(compiled.silu_mul(gate_up), reference.silu_mul(gate_up), **exact)

    qkv1 = torch.randn(rows, (4 + 2 * 2) * 32, generator=g).to(dtype)
    qkv2 = qkv1.clone()
    cos, sin = torch.randn(rows, 32, generator=g).to(dtype), torch.randn(rows, 32, generator=g).to(dtype)
    for qkv, backend in ((qkv1, compiled), (qkv2, reference)):
        backend.rotary_(qkv[:, :128].view(rows, 4, 32), qkv[:, 128:192].view(rows, 2, 32), cos, sin)
    torch.testing.assert_close(qkv1, qkv2, **exact)


def test_bf16_weights_are_packed_once_not_per_call():
    """oneDNN logs every reorder it runs (ONEDNN_VERBOSE): a packed layer runs none per call."""

    from pagedllm.backends.cpu.machine import gemm_isa

    if gemm_isa() == "avx2":
        pytest.skip("oneDNN packs bf16 weights only with avx512bw, avx512vl, avx512dq (or avx_ne_convert)")

    code = """
import torch
from pagedllm import backends
from pagedllm.layers.linear import Linear
layer = Linear(576, [1536], bias=False, backend=backends.get("cpu-torch"))
layer.weight.data = torch.randn(1536, 576).to(torch.bfloat16)
layer.pack()
assert layer.packed
x = torch.randn(8, 576).to(torch.bfloat16)
layer(x)
print("---calls---", flush=True)
for _ in range(3):
    layer(x)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "ONEDNN_VERBOSE": "1"},
    )
    assert out.returncode == 0, out.stderr
    calls = out.stdout.split("---calls---", 1)[1]
    assert "matmul" in calls or "inner_product" in calls, calls[:500]  # oneDNN ran the layer
    assert "reorder" not in calls, calls[:2000]


def test_linear_falls_back_to_f_linear_without_the_packing_ops(monkeypatch):
    from pagedllm.backends.cpu import torch_backend as cpu_torch
    from pagedllm.layers.linear import Linear

    def missing(*args, **kwargs):
        raise AttributeError("_reorder_linear_weight is not in this torch")

    layer = Linear(64, [32, 16], bias=True, backend=torch_backend())
    g = torch.Generator().manual_seed(0)
    layer.weight.data = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    layer.bias.data = torch.randn(48, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(cpu_torch, "_reorder", missing)
    layer.pack()
    assert not layer.packed
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
