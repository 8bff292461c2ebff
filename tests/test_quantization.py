"""Weights kept quantized: the kernels against dequantize + GEMM, GGUF files of every supported
type loaded quantized (and dequantized: the same model), float checkpoints quantized at load,
the planner's count of quantized weights, and a clear error for a type we do not load."""

import copy

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from kernel_paths import compiled_backend, torch_backend
from test_models_match_transformers import BF16_WEIGHTS

from pagedllm.errors import UnsupportedModelError
from pagedllm.layers import quantized as Q
from pagedllm.layers.codebooks import CODEBOOKS
from pagedllm.loading import gguf_convert
from pagedllm.loading.checkpoint import checkpoint_weights, load_decoder
from pagedllm.memory.footprint import weight_bytes


@pytest.mark.parametrize("scheme, cols", [("int8", 256), ("int4", 288)])
def test_quantize_keeps_every_weight_within_half_a_step(scheme, cols):
    """The step is the test's own arithmetic on the weights (int8: a row's absmax / 127; int4 on
    a width that is no whole number of 256-column blocks: a group of 32's (max - min) / 15), not
    the layer's scale: a scale 10% off fails."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, cols, generator=g) * torch.linspace(0.01, 3, 48)[:, None]  # rows of very different scales
    qw = Q.quantize(w, scheme)
    if scheme == "int8":
        step = (w.abs().amax(dim=1, keepdim=True) / 127).expand(-1, cols)
    else:
        groups = w.view(48, cols // 32, 32)
        step = ((groups.amax(dim=2) - groups.amin(dim=2)) / 15).repeat_interleave(32, dim=1)
    assert qw.block_type is None
    assert torch.allclose(qw.scale.repeat_interleave(qw.group, dim=1), step, rtol=1e-6)
    error = (compiled_backend().dequantize(qw, torch.float32) - w).abs()
    assert error.le(step / 2 + 1e-6).all()
    assert error.max() > step.min() / 4, "the rounding must be seen (a stub returning w passes nothing)"
    assert qw.nbytes() < w.numel() * (1.26 if scheme == "int8" else 0.76)


def test_int4_on_whole_blocks_is_q4_k_as_the_gguf_package_reads_it():
    """int4 on widths of whole 256-column blocks writes GGUF Q4_K blocks (4.5 bits a weight):
    read back by the gguf package's dequantize, every weight is within its group's step (the
    test's own (max - min(0, min)) / 15 per 32 columns; the encoder may clip a group's extreme by
    less than a step where that lowers its squared error) plus a unit of the block's d (its
    largest step / 63, the sub-scales' 6-bit grain), and the error's mean square is a uniform
    rounding's (step^2 / 12) within 20%, whatever the signs."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 512, generator=g) * torch.linspace(0.01, 3, 48)[:, None]
    w[3], w[4], w[5] = w[3].abs(), -w[4].abs(), 0  # all positive, all negative, all zero
    w[6, :32] *= 0.05  # a small group beside large ones in its block
    qw = Q.quantize(w, "int4")
    assert qw.block_type == "Q4_K" and qw.nbytes() == 48 * 512 * 4.5 / 8
    values = torch.from_numpy(gguf.quants.dequantize(qw.qweight.numpy(), GGMLQuantizationType.Q4_K))
    groups = w.view(48, 2, 8, 32)
    step = (groups.amax(dim=3) - groups.amin(dim=3).clamp(max=0)) / 15
    unit = step.amax(dim=2, keepdim=True).expand(-1, -1, 8) / 63
    bound = (step + unit).repeat_interleave(32, dim=2).reshape(48, 512) * 1.01 + 1e-7
    error = (values - w).abs()
    assert error.le(bound).all() and error[5].eq(0).all()
    uniform = (step.square() / 12).repeat_interleave(32, dim=2).reshape(48, 512)
    assert (error.square().sum() / uniform.sum()).item() < 1.2
    assert error.max() > bound.max() / 10, "the rounding must be seen"
    torch.testing.assert_close(compiled_backend().dequantize(qw, torch.float32), values, rtol=0, atol=0)


# (bits, group, with offsets, codebook, scale dtype): our int8/int4 and the layouts GGUF types
# unpack to (Q8_0 and Q5_0; Q5_1; MXFP4's and IQ4_NL/IQ4_XS's 4-bit codes; with their file's
# float16 scales: Q4_1, Q8_0, Q5_1, Q4_0's codes q - 8, IQ4_NL; Q5_0 and Q5_1 in 5 bits)
F16, F32 = torch.float16, torch.float32
FORMATS = [
    (8, 256, False, None, F32),
    (4, 32, True, None, F32),
    (8, 32, False, None, F32),
    (8, 16, False, None, F32),
    (8, 32, True, None, F32),
    (4, 32, False, "mxfp4", F32),
    (4, 32, False, "iq4_nl", F32),
    (4, 32, True, None, F16),
    (8, 32, False, None, F16),
    (8, 32, True, None, F16),
    (4, 32, False, "q4_0", F16),
    (4, 32, False, "iq4_nl", F16),
    (5, 32, False, "q5_0", F16),
    (5, 32, True, None, F16),
    (5, 32, True, None, F32),
    (4, 32, False, "mxfp4", torch.uint8),  # MXFP4's scale byte e: 2^(e - 128)
]


def random_quantized(rows, cols, bits, group, zero, codebook=None, scale_dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if bits in (4, 5):  # 5-bit: 20 bytes (qh, qs) per 32 columns
        width = cols // 2 if bits == 4 else cols // 32 * 20
        q = torch.randint(0, 256, (rows, width), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    scale = torch.rand(rows, cols // group, generator=g) / 50
    offset = torch.randn(rows, cols // group, generator=g) / 10 if zero else None
    if codebook is not None:  # the codes' values reach 127: scales as small as a 4-bit step's
        scale /= max(abs(v) for v in CODEBOOKS[codebook]) / 15
    offset = None if offset is None else offset.to(scale_dtype)
    if scale_dtype == torch.uint8:  # exponent bytes e: 2^(e - 128) from 2^-10 to 2^-7, as MXFP4's are
        return Q.QuantizedWeight(
            q, torch.randint(118, 122, scale.shape, generator=g, dtype=torch.uint8), None, bits, group, codebook
        )
    return Q.QuantizedWeight(q, scale.to(scale_dtype), offset, bits, group, codebook)


@pytest.mark.parametrize("bits, group, zero, codebook, scale_dtype", FORMATS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_quantized_matmul_equals_dequantize_then_gemm(ops, bits, group, zero, codebook, scale_dtype, rows):
    """fp32 activations: the kernel computes with the exact weight values. bf16 ones on 4- or
    8-bit weights in groups of 32 (8-bit in groups of 16 too) also quantize each row of x to 8
    bits per 32 columns (integer dot products): within 1% of the exact product. Row counts and
    37 channels that leave every remainder of the kernels' row blocks and channel tiles; the
    kernel itself for every count (the backend may take dequantize + GEMM from a few rows on)."""
    w = random_quantized(37, 512, bits, group, zero, codebook, scale_dtype)
    x = torch.randn(rows, 512)
    exact = x @ torch_backend().dequantize(w, torch.float32).T
    kernel = ops.quant_linear(x, w.qweight, w.scale, w.zero, w.layout, w.group)
    torch.testing.assert_close(kernel, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled_backend().quantized_matmul(x, w), exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch_backend().quantized_matmul(x, w), exact, rtol=1e-4, atol=1e-4)
    got = compiled_backend().quantized_matmul(x.bfloat16(), w).float()
    assert got.dtype == torch.float32 and (got - exact).norm() <= 0.01 * exact.norm()


def test_dequantize_kernel_equals_the_torch_path_and_picks_rows(ops):
    for bits, group, zero, codebook, scale_dtype in FORMATS:
        w = random_quantized(40, 256, bits, group, zero, codebook, scale_dtype)
        full = torch_backend().dequantize(w, torch.float32)
        torch.testing.assert_close(compiled_backend().dequantize(w, torch.float32), full, rtol=1e-6, atol=1e-7)
        rows = torch.tensor([39, 0, 7, 7])
        torch.testing.assert_close(compiled_backend().dequantize(w, torch.bfloat16, rows=rows), full[rows].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        compiled_backend().dequantize(w, torch.float32, rows=torch.tensor([40]))


# ---- K-quants kept as the file stores them -------------------------------------------------

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # IQ4_XS: super-blocks kept as the K-quants
# Byte offsets of each K-quant's f16 d (and dmin) in its block (ggml-common.h)
_K_F16 = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}


def k_quant_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks: every bit of the quants, sub-scales and high-bit planes random, d
    and dmin small f16 numbers of either sign (so that sums of many products stay comparable)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, cols // block, size)
    for offset in _K_F16[type_name]:
        d = (rng.standard_normal(blocks.shape[:2]) / 100).astype(np.float16)
        blocks[..., offset : offset + 2] = d[..., None].view(np.uint8)
    return raw


@pytest.mark.parametrize("type_name", K_QUANTS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 17])
def test_k_quants_kept_as_stored_multiply_as_the_gguf_package_dequantizes_them(ops, type_name, rows):
    """A K-quant matrix in its file's bytes (no float scale, no widened value): fp32 rows give
    x @ W^T with W as ``gguf.quants.dequantize`` reads the blocks; bf16 rows within 1% (8-bit
    rounded activations on VNNI, bf16 tiles on AMX); the dequantize kernel is gguf's bit for bit,
    and picks rows. 1280 columns: five blocks, so an odd count of them and both halves of each."""
    cols = 1280
    raw = k_quant_blocks(type_name, 37, cols, seed=rows)
    w = Q.QuantizedWeight.of_blocks(torch.from_numpy(raw), type_name)
    assert w.shape == (37, cols) and w.nbytes() == raw.nbytes  # the file's bytes, no more
    values = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[type_name]))
    torch.testing.assert_close(compiled_backend().dequantize(w, torch.float32), values, rtol=0, atol=0)
    picked = torch.tensor([36, 0, 5, 5])
    torch.testing.assert_close(compiled_backend().dequantize(w, torch.bfloat16, rows=picked), values[picked].bfloat16())
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    exact = (x.double() @ values.double().T).float()
    atol = 1e-4 * max([1.0, *exact.abs().flatten().tolist()])
    kernel = ops.quant_linear(x, w.qweight, w.scale, w.zero, w.layout, w.group)
    torch.testing.assert_close(kernel, exact, rtol=1e-4, atol=atol)
    for backend in (compiled_backend(), torch_backend()):
        torch.testing.assert_close(backend.quantized_matmul(x, w), exact, rtol=1e-4, atol=atol)
    got = ops.quant_linear(x.bfloat16(), w.qweight, w.scale, w.zero, w.layout, w.group).float()
    assert (got - exact).norm() <= 0.01 * exact.norm()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_one_bf16_row_reads_one_channel_at_a_time_or_four_to_the_same_sums(ops, type_name):
    """One bf16 row against a K-quant matrix reads one channel at a time (weights streaming from
    memory) or four (weights in the caches): the same integer sums in the same order, so the same
    floats, each within 1% of x @ W^T with W as the gguf package reads it. 37 channels: nine tiles
    of four and one left over; 1280 columns: five blocks, one past the one-channel walk's four."""
    raw = k_quant_blocks(type_name, 37, 1280, seed=3)
    w = Q.QuantizedWeight.of_blocks(torch.from_numpy(raw), type_name)
    values = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[type_name]))
    x = torch.randn(1, 1280, generator=torch.Generator().manual_seed(3)).bfloat16()
    exact = (x.double() @ values.double().T).float()
    got = []
    for by_channel in (True, False):
        before = ops.set_k_quant_row_by_channel(by_channel)
        try:
            got.append(ops.quant_linear(x, w.qweight, w.scale, w.zero, w.layout, w.group).float())
        finally:
            ops.set_k_quant_row_by_channel(before)
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    assert (got[0] - exact).norm() <= 0.01 * exact.norm()


def test_one_row_walk_follows_whether_the_held_weights_outgrow_the_l3(ops, monkeypatch):
    """The backend reads K-quants one channel at a time once the weights of the models it holds
    (a draft beside its target counts too) are more than the L3, four at a time while they fit,
    one at a time where the L3's size is unknown; a model freed stops counting."""
    import gc
    import weakref

    from pagedllm.backends.cpu import compiled_backend as compiled
    from pagedllm.backends.cpu import machine

    class Held:  # what the backend reads of a model
        def __init__(self, nbytes: int):
            self.nbytes = nbytes

        def weight_bytes(self) -> int:
            return self.nbytes

    monkeypatch.setattr(machine, "l3_bytes", lambda: 32 << 20)
    monkeypatch.setattr(compiled, "_HELD", weakref.WeakKeyDictionary())
    backend = compiled_backend()
    before = ops.set_k_quant_row_by_channel(True)
    try:
        target = Held(20 << 20)
        backend.hold_weights(target)  # 20 MiB in a 32 MiB L3: four channels
        assert ops.set_k_quant_row_by_channel(False) is False
        draft = Held(13 << 20)
        backend.hold_weights(draft)  # 33 MiB held: one channel
        assert ops.set_k_quant_row_by_channel(False) is True
        del draft
        gc.collect()
        backend.hold_weights(target)  # 20 MiB again
        assert ops.set_k_quant_row_by_channel(False) is False
        monkeypatch.setattr(machine, "l3_bytes", lambda: 0)
        backend.hold_weights(target)
        assert ops.set_k_quant_row_by_channel(False) is True
    finally:
        ops.set_k_quant_row_by_channel(before)


def test_k_quant_blocks_of_another_size_are_refused(ops):
    raw = torch.zeros(2, 143, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of its block"):
        Q.QuantizedWeight.of_blocks(raw, "Q4_K")
    w = Q.QuantizedWeight.of_blocks(torch.zeros(2, 144, dtype=torch.uint8), "Q4_K")
    with pytest.raises(RuntimeError, match=r"blocks x 144"):
        ops.quant_linear(torch.zeros(1, 256), raw, w.scale, None, w.layout, w.group)


# ---- GGUF files ---------------------------------------------------------------------------

H, FF, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 96
# A type per tensor, so one file covers every supported type, stacked layers mixing formats
# (q/k/v of three types: three segments), and float tensors beside them.
TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q8_0",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q5_K",
    "token_embd": "Q8_0",
    "output": "F32",
}
# The types read since, in a second file of the same shape: q/k/v of Q5_0, Q5_1 and MXFP4 (two
# 8-bit segments, the second with offsets, then 4-bit codes), MXFP4 in a row-parallel layer, and
# float tensors stored in 16 bits; and in a third, IQ4_NL and IQ4_XS (gate and up: two coded
# segments of one codebook, stacked into one).
LATER_TYPES = {
    **TYPES,
    "attn_q": "Q5_0",
    "attn_k": "Q5_1",
    "attn_v": "MXFP4",
    "ffn_down": "MXFP4",
    "token_embd": "BF16",
    "output": "F16",
}
CODED_TYPES = {**TYPES, "attn_q": "IQ4_NL", "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_NL", "token_embd": "IQ4_XS"}
# Every K-quant, kept as its blocks: q/k/v of Q2_K, Q3_K and Q6_K (three segments), gate/up of
# Q4_K and Q5_K, the embedding Q4_K and lm_head Q6_K, as a Q4_K_M file has them.
K_TYPES = {
    **TYPES,
    "attn_q": "Q2_K",
    "attn_k": "Q3_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q2_K",
    "token_embd": "Q4_K",
    "output": "Q6_K",
}


def gguf_blocks(type_name, rows, cols, rng):
    """Random blocks of ``type_name`` with small finite scales, as a trained model has."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2]}
    fields.update(Q5_K=[0, 2], Q6_K=[208], Q2_K=[80, 82], Q3_K=[108])
    for offset in fields.get(type_name, []):  # a type we do not load: any bytes will do
        d = rng.random(raw.shape[:2]) * 0.004 + 0.001
        if type_name == "Q6_K":  # its int8 sub-scales reach 127, its q 32: weights of 1/20 of that
            d /= 20
        d = d.astype(np.float16)
        raw[..., offset : offset + 2] = d[..., None].view(np.uint8)
    if type_name == "MXFP4":  # its scale byte e: 2^(e - 127) of 1/512 to 1/128
        raw[..., 0] = rng.integers(118, 121, raw.shape[:2])
    if type_name in ("IQ4_NL", "IQ4_XS"):  # codes reach 127: d of 1/16 of a 4-bit type's
        d = (rng.random(raw.shape[:2]) * 0.0003 + 0.0001).astype(np.float16)
        raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def float_tensor(kind, rows, cols, rng):
    """Random weights stored as ``kind`` (F32, F16 or BF16): the array to write (BF16 as its
    bytes) and the float32 values it holds, rounded by numpy or torch, not by gguf."""
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == "F16":
        return values.astype(np.float16), values.astype(np.float16).astype(np.float32)
    if kind == "BF16":
        bf16 = torch.from_numpy(values).bfloat16()
        return bf16.view(torch.int16).numpy().view(np.uint8), bf16.float().numpy()
    return values, values


def write_llama_gguf(path, types, rng, metadata=None, dequantized=False):
    """``dequantized``: the same tensors (the same draws of ``rng``), each quantized one written
    as the float32 values the ``gguf`` package dequantizes it to, each float one as float32.
    Returns the float32 values of the float tensors written, by GGUF name."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (metadata or {}).items():
        (writer.add_int32 if isinstance(value, int) else writer.add_float32)(key, value)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(256)
    shapes = {"attn_q": (H, H), "attn_k": (H // 2, H), "attn_v": (H // 2, H), "attn_output": (H, H)}
    shapes.update(ffn_gate=(FF, H), ffn_up=(FF, H), ffn_down=(H, FF))

    written = {}

    def add(name, kind, rows, cols):
        if kind in ("F32", "F16", "BF16"):
            stored, written[name] = float_tensor(kind, rows, cols, rng)
            if dequantized:
                writer.add_tensor(name, written[name])
            else:
                writer.add_tensor(name, stored, raw_dtype=GGMLQuantizationType.BF16 if kind == "BF16" else None)
        elif dequantized:
            values = gguf.quants.dequantize(gguf_blocks(kind, rows, cols, rng), GGMLQuantizationType[kind])
            writer.add_tensor(name, values.astype(np.float32))
        else:
            writer.add_tensor(name, gguf_blocks(kind, rows, cols, rng), raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", types["token_embd"], VOCAB, H)
    add("output.weight", types["output"], VOCAB, H)
    writer.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for i in range(LAYERS):
        for name, shape in shapes.items():
            add(f"blk.{i}.{name}.weight", types[name], *shape)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(H, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """GGUF files converted in this process (the tokenizer step skipped: they carry none)."""
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *a: None)

    def convert(types, dequantized=False):
        name = "dequantized" if dequantized else "tiny"
        path, out = tmp_path / f"{name}.gguf", tmp_path / f"{name}-converted"
        write_llama_gguf(path, types, np.random.default_rng(0), dequantized=dequantized)
        out.mkdir()
        gguf_convert.convert(path, out)
        return out

    return convert


def logits_of(model, ids, dtype=torch.float32):
    from pagedllm.backends.cpu.attention import SequenceSlice, StepLayout
    from pagedllm.backends.cpu.kv_cache import KVCache

    cache = KVCache(model.config, num_blocks=4, block_size=16, dtype=dtype)
    layout = StepLayout.from_slices([SequenceSlice(0, len(ids), len(ids), [0, 1, 2, 3][: -(-len(ids) // 16)])], 16, 2)
    rows = torch.arange(len(ids))
    return model(torch.tensor(ids), rows, model.backend.attention(cache, layout), rows)


@pytest.mark.parametrize(
    "types, qkv_formats",
    [
        (TYPES, [(772, 32, False, F16), (8, 32, False, F16), (4110, 256, False, F32)]),
        (LATER_TYPES, [(1029, 32, False, F16), (5, 32, True, F16), (260, 32, False, torch.uint8)]),
        (CODED_TYPES, [(516, 32, False, F16), (8, 32, False, F16), (4110, 256, False, F32)]),
        (K_TYPES, [(4106, 256, False, F32), (4107, 256, False, F32), (4110, 256, False, F32)]),
    ],
    ids=["first-six", "q5-mxfp4-f16", "iq4", "k-quants"],
)
def test_every_supported_gguf_type_runs_quantized_as_the_gguf_package_dequantizes_it(
    converted, kernels, types, qkv_formats
):
    """Two files that hold every supported type between them (q/k/v of three types stacked),
    kept quantized: their logits equal those of the same model written as the float32 values the
    ``gguf`` package dequantizes each tensor to, on both kernel paths, for rows that take the
    kernel (1) and the dequantize + GEMM path (20); and dequantized at load, the same."""
    model_dir = converted(types)
    quantized = load_decoder(model_dir, torch.float32, None)
    ours_dequantized = load_decoder(model_dir, torch.float32, "none")
    oracle = load_decoder(converted(types, dequantized=True), torch.float32, None)
    assert quantized.quantized() and not ours_dequantized.quantized() and not oracle.quantized()
    qkv = quantized.model.layers[0].self_attn.qkv_proj
    assert [s.format for s in qkv.segments] == qkv_formats
    ids = list(range(3, 23))
    for n in (1, len(ids)):
        expected = logits_of(oracle, ids[:n])
        # float32 sums in another order, grown through the layers: 1e-4 of the largest logit
        # (the K-quant file's random sub-scales give logits of ~16, the others' ~4)
        tolerance = 1e-4 * max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(logits_of(quantized, ids[:n]), expected, rtol=1e-4, atol=tolerance)
        torch.testing.assert_close(logits_of(ours_dequantized, ids[:n]), expected, rtol=1e-5, atol=1e-5)
    # the planner's figure from the header is what the loaded model holds
    assert checkpoint_weights(model_dir, "float32", None) == (quantized.weight_bytes(), True)
    assert quantized.weight_bytes() < ours_dequantized.weight_bytes() / 3


def test_k_quant_layers_stream_through_slots_as_their_blocks(converted):
    """Layers streamed from the converted file (layers/layer_stream.py) hold a K-quant's blocks
    in their slots as a loaded layer holds them: the same logits to the bit, every layer resident,
    one resident and one streamed, both taking turns in one slot."""
    model_dir = converted(K_TYPES)
    loaded = load_decoder(model_dir, torch.float32, None)
    ids = list(range(3, 23))
    expected = logits_of(loaded, ids)
    for resident, slots in ((1, 1), (0, 1)):
        streamed = load_decoder(model_dir, torch.float32, None, streamed_layers=(resident, slots))
        assert streamed.layer_stream is not None
        assert torch.equal(logits_of(streamed, ids), expected), (resident, slots)
    assert streamed.weight_bytes() < loaded.weight_bytes()  # two layers in one slot


def test_f16_and_bf16_tensors_load_as_the_values_written(tmp_path, monkeypatch):
    """A GGUF's 16-bit float tensors (the embedding in BF16, lm_head in F16) reach the loaded
    model as exactly the values written."""
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *a: None)
    path, out = tmp_path / "floats.gguf", tmp_path / "converted"
    written = write_llama_gguf(path, LATER_TYPES, np.random.default_rng(0))
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name in written}
    assert stored == {"token_embd.weight": "BF16", "output.weight": "F16"}
    out.mkdir()
    gguf_convert.convert(path, out)
    model = load_decoder(out, torch.float32, None)
    embedding = model.model.embed_tokens(torch.arange(VOCAB))
    assert torch.equal(embedding, torch.from_numpy(written["token_embd.weight"]))
    lm_head = model.lm_head(torch.eye(H)).T  # the rows, however the layer packed them
    assert torch.equal(lm_head, torch.from_numpy(written["output.weight"]))


@pytest.mark.parametrize("kind", ["IQ3_S", "IQ2_XS"])
def test_a_gguf_type_we_do_not_load_is_named_in_the_error(converted, kind):
    with pytest.raises(UnsupportedModelError, match=kind) as e:
        converted({**TYPES, "ffn_down": kind})
    assert "blk.0.ffn_down.weight" in str(e.value) and "Q4_K" in str(e.value)


# ---- float checkpoints quantized at load ------------------------------------------------------


def rounded_as_documented(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """The test's own rounding, from docs/quantization.md: int8 to a row's absmax / 127 steps
    around 0; int4 to (max - min) / 15 steps up from each group of 32's min."""
    w = w.float()
    if scheme == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
        return (w / step).round() * step
    groups = w.view(w.shape[0], -1, 32)
    low = groups.amin(dim=2, keepdim=True)
    step = (groups.amax(dim=2, keepdim=True) - low) / 15
    return (((groups - low) / step).round() * step + low).view_as(w)


def with_rounded_weights(hf, scheme: str, dtype: torch.dtype):
    """transformers' model with every matrix rounded as pagedllm's ``scheme`` documents it
    (embeddings and lm_head in int8), from the weights as loaded in ``dtype``; and the rounding's
    relative error, root mean square over the matrices."""
    model, errors = copy.deepcopy(hf), []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                loaded = p.to(dtype).float()
                r = rounded_as_documented(loaded, "int8" if "embed" in name or "lm_head" in name else scheme)
                errors.append(float((r - p).norm() / p.norm()))
                p.copy_(r)
    return model, (sum(e * e for e in errors) / len(errors)) ** 0.5


def activations_rounded_to_8_bits() -> bool:
    """docs/quantization.md: 4-bit layers round a few bf16 rows of x to 8 bits on AVX512-VNNI:
    with the compiled kernels built for this machine, on a CPU that has it (a build for an older
    target, x86-64-v3 in test_kernel_targets, computes in float)."""
    from pagedllm.backends.cpu.machine import cpu_flags
    from pagedllm.kernels import build, compiled_ops

    return compiled_ops() is not None and build.build_target() == "native" and "avx512_vnni" in cpu_flags()


def with_activations_rounded_as_documented(model):
    """A copy of ``model`` whose decoder linears first round each row of x to 8 bits per 32
    columns (absmax / 127), as docs/quantization.md says 4-bit layers do for bfloat16 activations
    on a few rows."""
    model = copy.deepcopy(model)

    def round_input(module, args):
        groups = args[0].float().unflatten(-1, (-1, 32))
        step = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127
        return ((groups / step).round() * step).flatten(-2).to(args[0].dtype)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(round_input)
    return model


# How far a model's logits move, as a share of their largest, per unit of relative weight error:
# measured 6-13 on the tiny models (their large random weights amplify errors; int8 moves their
# logits 4-8%, int4 45-70%), so a quantized model may be that far from its float self.
ROUNDING_AMPLIFICATION = 15


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", Q.SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_float_checkpoint_quantized_at_load_is_the_float_model_on_rounded_weights(
    tiny_checkpoints, arch, scheme, dtype
):
    """transformers computes the oracle on weights the test rounds itself, from the weights as
    loaded in ``dtype`` (llama: an untied lm_head in int8; qwen2: q/k/v biases, lm_head tied to
    the int8 embeddings). float32 activations: equal to rounding. bfloat16: as close to the
    oracle's float32 logits as transformers' own bf16 run is; on up to 8 rows 4-bit layers also
    round x to 8 bits, and so does the oracle. And the quantized model stays within the format's
    rounding error, amplified, of the float model it came from. A scale 10% off fails."""
    model_dir, hf = tiny_checkpoints[arch]
    torch_dtype = getattr(torch, dtype)
    quantized = load_decoder(model_dir, torch_dtype, scheme)
    assert quantized.quantized() and isinstance(quantized.model.embed_tokens, Q.QuantizedEmbedding)
    assert quantized.weight_bytes() == checkpoint_weights(model_dir, dtype, scheme)[0]
    assert quantized.weight_bytes() == weight_bytes(quantized.config, dtype, scheme)
    float32_bytes = 4 * sum(p.numel() for p in hf.parameters())
    assert quantized.weight_bytes() < float32_bytes / (3 if scheme == "int8" else 4)
    rounded_weights, weight_error = with_rounded_weights(hf, scheme, torch_dtype)
    ids = list(range(5, 30))
    for n in (8, len(ids)):  # the kernel (up to 8 rows), then dequantize + GEMM
        ours = logits_of(quantized, ids[:n], torch_dtype).float()
        w4a8 = dtype == "bfloat16" and scheme == "int4" and n <= 8 and activations_rounded_to_8_bits()
        oracle = with_activations_rounded_as_documented(rounded_weights) if w4a8 else rounded_weights
        oracle_bf16 = copy.deepcopy(oracle).to(torch.bfloat16)
        with torch.no_grad():
            truth = oracle(torch.tensor([ids[:n]])).logits[0].float()
            unrounded = hf(torch.tensor([ids[:n]])).logits[0].float()
            theirs = oracle_bf16(torch.tensor([ids[:n]])).logits[0].float()
        if dtype == "float32":
            torch.testing.assert_close(ours, truth, rtol=1e-4, atol=1e-4)
            moved = float((ours - unrounded).abs().max() / unrounded.abs().max())
            assert moved <= ROUNDING_AMPLIFICATION * weight_error, (moved, weight_error)
        else:
            assert (ours - truth).abs().max() <= 1.5 * (theirs - truth).abs().max()
            assert (ours - theirs).abs().max() <= BF16_WEIGHTS.logit_tolerance * theirs.abs().max()


# ---- w8a8: int8 weights and int8 activations --------------------------------------------------


def with_activations_rounded_per_row(model):
    """A copy of ``model`` whose every linear layer (lm_head too) first rounds each row of its
    input to int8 steps of the row's absmax / 127, as docs/quantization.md says w8a8 does."""
    model = copy.deepcopy(model)

    def round_input(module, args):
        x = args[0].float()
        step = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127
        return ((x / step).round() * step).to(args[0].dtype)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_input)
    return model


@pytest.mark.parametrize("rows, k, n", [(1, 64, 7), (5, 40, 10), (3, 17, 4), (9, 576, 100), (33, 1000, 37)])
def test_w8a8_op_sums_exactly_what_the_rounded_integers_give(ops, rows, k, n):
    """The op's integer GEMM (oneDNN's where the CPU has VNNI dot products; int8_gemm.cpp's own
    on AVX2, which test_kernel_targets.py runs this on) sums exactly: any row count (4-row
    tiles and their rest), any channel count (3-channel tiles), columns past the last 16, and
    weights of -128 and 127. Oracle: x rounded per row as docs/quantization.md says, the sums
    in float64 (exact at these sizes), scaled in float32 in the op's order. A rest of columns
    dropped, or pairs summed in 16 bits as oneDNN does without VNNI: fails."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g) * 3
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w[0, :] = 127 if n > 1 else w[0, :]  # the largest products a 16-bit pair sum would saturate on
    w[-1, :] = -128
    x[0, : k // 2] = x[0].abs().max()  # a row of full-scale values: q = 127 over half of it
    scale = torch.rand(n, generator=g) + 0.1
    step = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    q = torch.round(x / step)
    sums = (q.double() @ w.double().t()).float()
    assert torch.equal(ops.w8a8_linear(x, w, scale), sums * step * scale.view(1, -1))


def test_the_plan_knows_which_integer_gemm_the_kernels_sum_w8a8_in(ops):
    """``pagedllm plan`` predicts, without loading the kernels, whether the w8a8 op sums in its
    own AVX2 GEMM (built without VNNI) or oneDNN's: their transients differ, and the memory grid
    holds the plan to within 10% of what the step takes (``workspace``)."""
    from pagedllm.backends import cpu

    assert cpu.facts("cpu-compiled", "float32").own_int8_sums == ops.w8a8_own_sums()
    assert not cpu.facts("cpu-torch", "float32").own_int8_sums


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w8a8_is_the_float_model_with_weights_and_activations_rounded_to_int8(tiny_checkpoints, kernels, arch):
    """w8a8: every matrix in int8 per row (llama's untied lm_head too; qwen2's lm_head is its int8
    embeddings) and each row of every linear layer's input rounded to int8 at run time, the
    products summed in integers. The oracle is transformers on weights and inputs the test rounds
    itself; in float32 the two agree to summation order, on 1 row, 8 and 25. Without the inputs'
    rounding, or with a step of absmax / 128, the logits move ~1e-2 of their largest: fails."""
    model_dir, hf = tiny_checkpoints[arch]
    ours = load_decoder(model_dir, torch.float32, "w8a8")
    layers = [m for m in ours.modules() if isinstance(m, Q.QuantizedLinear)]
    assert layers and all(m.int8_activations for m in layers) and isinstance(ours.lm_head, Q.QuantizedLinear)
    assert ours.weight_bytes() == checkpoint_weights(model_dir, "float32", "w8a8")[0]
    assert ours.weight_bytes() == weight_bytes(ours.config, "float32", "w8a8")
    rounded, _ = with_rounded_weights(hf, "int8", torch.float32)
    oracle = with_activations_rounded_per_row(rounded)
    ids = list(range(5, 30))
    for n in (1, 8, len(ids)):
        with torch.no_grad():
            truth = oracle(torch.tensor([ids[:n]])).logits[0]
            weights_only = rounded(torch.tensor([ids[:n]])).logits[0]
        got = logits_of(ours, ids[:n]).float()
        torch.testing.assert_close(got, truth, rtol=1e-4, atol=1e-4)
        assert (weights_only - truth).abs().max() > 1e-3 * truth.abs().max(), "the inputs' rounding must show"


def test_w8a8_requantizes_tensors_stored_in_other_formats_to_int8_per_row(converted):
    """A GGUF's Q4_K / Q6_K / ... tensors under w8a8: dequantized as the ``gguf`` package reads
    them, then int8 per row, every value within half a step of the stored one."""
    model_dir = converted(TYPES)
    stored = load_decoder(converted(TYPES, dequantized=True), torch.float32, None)
    ours = load_decoder(model_dir, torch.float32, "w8a8")
    floats = dict(stored.named_modules())
    checked = 0
    for name, m in ours.named_modules():
        if isinstance(m, Q.QuantizedLinear) and hasattr(floats.get(name), "weight"):
            (w,) = m.segments
            assert (w.bits, w.group, w.zero) == (8, m.in_features, None)
            k = m.in_features
            reference = floats[name](torch.eye(k)).T  # the float rows, however the layer packed them
            step = reference.abs().amax(dim=1, keepdim=True) / 127
            error = (Q.dequantize_reference(w, torch.float32) - reference).abs()
            assert error.le(step / 2 + 1e-6).all(), name
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("groups", range(1, 9))
def test_kernel_on_bf16_rows_sums_what_the_documented_rounding_gives(groups, bits, group, ops):
    """The AVX512-VNNI path reads 4 groups of 32 columns at a time: every width of the last read
    (1-4 groups) and the offsets' tail must count each column once; 8-bit weights (Q8_0) are
    signed, which the unsigned-by-signed dot product must undo exactly; 8-bit weights in groups
    of 16 (Q6_K widened) scale each half of x's 32 columns by its own weight scale. Oracle: x
    rounded to 8 bits per 32 columns as docs/quantization.md says, times q * scale + zero, in
    float64."""
    if not activations_rounded_to_8_bits():
        pytest.skip("the kernels compute in float on this machine")
    g = torch.Generator().manual_seed(groups)
    n, k = 37, 32 * groups
    per_row = k // group
    scale, zero = torch.rand(n, per_row, generator=g) + 0.1, torch.randn(n, per_row, generator=g)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g)
        low, high = q.view(n, groups, 2, 16).unbind(2)  # byte j of a block: column j low, j + 16 high
        packed = (low | (high << 4)).reshape(n, k // 2).to(torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g)
        packed = q.to(torch.int8)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    blocks = x.double().view(3, groups, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    x8 = ((blocks / step).round() * step).view(3, k)
    w = q.double() * scale.double().repeat_interleave(group, 1) + zero.double().repeat_interleave(group, 1)
    expected = x8 @ w.T
    got = ops.quant_linear(x, packed, scale, zero, bits, group).double()
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=8e-3 * float(expected.abs().max()))


def test_the_float_rows_rule_follows_the_vendor_each_side_was_measured_faster_on(ops, monkeypatch):
    """The compiled backend's float32 rule where the kernels leave it open (AVX-512): on an Intel
    CPU (dequantize + GEMM measured 2.7x faster at 64 rows) the packed-weight kernel takes at most
    ``QUANT_KERNEL_MAX_ROWS``, on AMD's Zen 4 (the kernel measured faster at 8-512 rows) any count,
    on Zen 5 (dequantize + GEMM 1.66x faster at 256 rows) 64; either way a product equals the
    dequantized weights' GEMM."""
    from pagedllm.backends.cpu import float_rows_rule, machine
    from pagedllm.backends.cpu.compiled_backend import CPUCompiledBackend
    from pagedllm.backends.cpu.workspace import QUANT_FLOAT_ANY_ROWS, QUANT_FLOAT_AVX2_ROWS, QUANT_KERNEL_MAX_ROWS

    w = random_quantized(37, 512, 4, 32, True, None, F16)
    x = torch.randn(64, 512)
    exact = x @ torch_backend().dequantize(w, torch.float32).T
    monkeypatch.setattr(ops, "quant_float_max_rows", lambda: QUANT_FLOAT_ANY_ROWS, raising=False)
    cases = [("GenuineIntel", 6, QUANT_KERNEL_MAX_ROWS), ("AuthenticAMD", 25, QUANT_FLOAT_ANY_ROWS)]
    cases += [("AuthenticAMD", 26, QUANT_FLOAT_AVX2_ROWS)]
    for vendor, family, rule in cases:
        monkeypatch.setattr(machine, "cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(machine, "cpu_family", lambda family=family: family)
        backend = CPUCompiledBackend(ops)
        assert backend.quant_float_max_rows == rule == float_rows_rule.quant_float_max_rows(ops, vendor, family)
        assert backend.quant_kernel_takes(64, torch.float32) == (rule >= 64)
        assert backend.quant_kernel_takes(65, torch.float32) == (rule == QUANT_FLOAT_ANY_ROWS)
        assert backend.quant_kernel_takes(QUANT_KERNEL_MAX_ROWS, torch.float32)
        torch.testing.assert_close(backend.quantized_matmul(x, w), exact, rtol=1e-4, atol=1e-4)
