"""The footprint model: what an engine costs, as a polynomial in its sizes.

Pure arithmetic over a model description (``ModelConfig``, read from config.json alone) and the
engine's settings; it imports nothing from the engine and needs no weights, so it plans a 70B
model on a laptop.

The model of memory
-------------------
With N = KV-cache blocks, M = ``max_batch_tokens``, S = ``max_num_seqs``, L = ``max_model_len``::

    footprint(N, M, S) = weights + kv_block · N + activations(M, S, L) + buffers(M, S, L) + fixed

- ``weights``: every parameter times the weight dtype's size (tied embeddings counted once); with
  ``quantization``, linear weights at 1 byte + a float32 scale per row (int8) or half a byte + a
  float32 scale and offset per 32 (int4), embeddings and lm_head in int8 (w8a8: all int8). A checkpoint stored
  quantized (a converted GGUF) is counted from its header instead (``EngineSettings.weights_bytes``).
- ``kv_block = 2 · layers · block_size · kv_heads · (head_dim · kv_dtype_size + scale)``: K and V
  of one block in every layer (an 8-bit cache keeps a float32 scale per token and head). The
  cache is allocated once, so this term is exact.
- ``activations``: the peak of live tensors during one step, above the weights and the cache.
  It is the largest of the step's phases (embedding, rotary tables, each sub-layer of a decoder
  layer, the final norm and logits, the sampler), each a sum of tensors whose sizes are products
  of the step's token count with the config's widths. Every phase is linear in M except:

  * attention: the CPU backend (``pagedllm.backends.cpu.attention``) scores at most ``pairs_budget`` query ·
    key pairs per KV head at once, so its scores are bounded by a constant; what remains is the
    gathered K/V of one sequence's context, linear in L;
  * logits and sampler: logits exist only for the S sampled rows (S · vocab · 4 bytes), and the
    sampler works on chunks of 8 rows, so its workspace is a constant (≈ 25 · 8 · vocab bytes).

- ``buffers``: the step's index tensors (token ids, positions, slot mapping: 8 bytes each per
  token; 8 bytes per context block gathered; a 1-byte padding mask per (decode row, key slot),
  which is bilinear in S and L: the one bilinear term, bounded by S · L).
- On bf16, oneDNN's GEMM kernels take a scratch buffer from torch's allocator, of a size that
  depends on the kind of kernel the CPU runs (AMX, AVX-512 with or without bf16; none on AVX2)
  and on the threads: the device's ``gemm_scratch`` (``backends.cpu.workspace``). On fp32 there is none.

What the model's shapes decide is here; how the device runs each phase (a norm's or attention's
temporaries by kernel path, a GEMM's padding and scratch, how attention tiles the decode rows,
the scratch outside torch's allocator) are the device's terms, asked through the registry
(``backends.workspace(s.device)``; the CPU's: ``backends/cpu/workspace.py``), never branched
on here.

``step_transient_bytes`` predicts the peak of one concrete step (its shape: tokens, sampled
rows, decode groups, prefill chunks); ``activation_peak`` is its maximum over every step the
limits allow, which is what the planner reserves. Both are checked against measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import backends, kinds
from ..backends.facts import ANY_ROWS
from ..config import ModelConfig
from ..kinds import PagedKV
from ..layers.superblocks import int4_bytes
from ..sizes import (
    CONVERT_CHUNK_BYTES,
    QUANTIZED,
    SAMPLER_CHUNK_ROWS,
    ceil_div,
    dtype_bytes,
)
from ..sizes import INDEX_BYTES as INDEX

SAMPLER_BYTES_PER_LOGIT = 25  # full sampling path: float32 copies, int64 sort order, masks
SCALAR_SLACK = 256  # one-element temporaries (eps, scale factors) that ops create on the way


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype, pool: int | None = None) -> int:
    """Bytes one block costs across the layers that keep paged K/V (or those of one pool of
    ``cfg.kv_pools``): the sum of their caches' bytes per token (``kinds.PagedKV``).
    The only place this is computed."""
    paged = [k.cache for k in cfg.layer_kinds if isinstance(k.cache, PagedKV)]
    if pool is not None:
        paged = [c for c in paged if cfg.kv_pools.index(c.window) == pool]
    return block_size * sum(c.bytes_per_token(kv_dtype) for c in paged)


def window_pool_blocks(window: int, block_size: int, max_batch_tokens: int, max_num_seqs: int) -> int:
    """The most blocks a sliding window's pool holds at once (``engine.block_pools``). Before a
    step that computes n tokens from position p, a sequence holds the blocks from the one holding
    p - window + 1 to the one holding p + n - 1: at most (n + window - 2) / block_size + 2 of them;
    summed over the running sequences, whose n add up to at most max_batch_tokens."""
    return ceil_div(max_batch_tokens + max_num_seqs * (window - 1), block_size) + 2 * max_num_seqs


def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter: the embeddings (and an untied lm_head), each layer's parts (their kinds'
    ``footprint.parameters``) and its two norms, the final norm."""
    h = cfg.hidden_size
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    layers = sum(_part(kind, "parameters", cfg, layer) + 2 * h for layer, kind in enumerate(cfg.layer_kinds))
    return embeddings + layers + h


def _part(kind, term: str, cfg: ModelConfig, layer: int):
    """A layer's mixer's and feed-forward's ``term`` (``parameters``: a sum; ``matrices``: a list)."""
    mixer = getattr(kinds.part(kind.mixer, "footprint"), term)(cfg, layer)
    return mixer + getattr(kinds.part(kind.feed_forward, "footprint"), term)(cfg, layer)


def _mlp_widths(cfg: ModelConfig, layer: int) -> list[int]:
    """The intermediate width of each SwiGLU MLP of a layer: its dense one, or every expert's
    (and a shared expert's)."""
    moe = cfg.moe
    if moe is None or not moe.layers[layer]:
        return [cfg.intermediate_size]
    return [moe.expert_size] * moe.num_experts + ([moe.shared_expert_size] if moe.shared_expert_size else [])


def linear_shapes(cfg: ModelConfig) -> tuple[int, int]:
    """(weights, rows) of every decoder layer's linear layers together that quantization
    touches (embeddings, lm_head and routers aside)."""
    matrices = list(_linear_matrices(cfg))
    return sum(r * c for r, c in matrices), sum(r for r, _ in matrices)


def _linear_matrices(cfg: ModelConfig):
    """(rows, columns) of each stacked linear layer of ``linear_shapes``, layer by layer: its
    kinds' ``footprint.matrices`` (attention's q/k/v and o, each MLP's gate/up and down...)."""
    for layer, kind in enumerate(cfg.layer_kinds):
        yield from _part(kind, "matrices", cfg, layer)


def active_linear_weights(cfg: ModelConfig) -> int:
    """The decoder layers' linear weights one token is multiplied by: ``linear_shapes``' less, in
    each sparse layer, the experts its router did not choose (all but ``top_k``)."""
    weights = linear_shapes(cfg)[0]
    moe = cfg.moe
    if moe is None:
        return weights
    return weights - sum(moe.layers) * (moe.num_experts - moe.top_k) * 3 * cfg.hidden_size * moe.expert_size


def largest_mlp_width(cfg: ModelConfig) -> int:
    return max(max(_mlp_widths(cfg, layer)) for layer in range(cfg.num_layers))


def router_count(cfg: ModelConfig) -> int:
    """The routers' weights: float32 whatever the dtype (``kinds.sparse_moe.forward``)."""
    moe = cfg.moe
    return 0 if moe is None else sum(moe.layers) * moe.num_experts * (cfg.hidden_size + moe.router_bias)


def weight_bytes(cfg: ModelConfig, dtype, quantization: str | None = None) -> int:
    routers = router_count(cfg) * (4 - dtype_bytes(dtype))  # widened to float32 at load
    return routers + _weight_bytes_in(cfg, dtype, quantization)


def _weight_bytes_in(cfg: ModelConfig, dtype, quantization: str | None) -> int:
    """Every weight in ``dtype`` or its quantized format (the routers too)."""
    if quantization in (None, "none"):
        return parameter_count(cfg) * dtype_bytes(dtype)
    linear, rows = linear_shapes(cfg)
    tables = 1 if cfg.tie_word_embeddings else 2
    embeddings = tables * cfg.vocab_size * (cfg.hidden_size + 4)  # int8, a float32 scale per row
    # norms, biases and routers stay in dtype
    rest = (parameter_count(cfg) - linear - tables * cfg.vocab_size * cfg.hidden_size) * dtype_bytes(dtype)
    if quantization in ("int8", "w8a8"):  # w8a8 stores int8 too (its lm_head as well)
        return linear + 4 * rows + embeddings + rest
    if quantization == "int4":
        return sum(int4_bytes(r, c) for r, c in _linear_matrices(cfg)) + embeddings + rest
    raise ValueError(f"quantization {quantization!r}: choose one of none, int8, int4, w8a8")


# float32 temporaries of quantizing a chunk of rows at load (layers/quantized.QUANTIZE_CHUNK_ELEMENTS
# weights): the float copy, its scaled copy, the rounded values, a mask; measured under 20 bytes each.
QUANTIZE_BYTES_PER_CHUNK = 4 * 1024 * 1024 * 20


# What building the model costs the process besides its tensors: modules, headers, the GEMM
# library's kernels for each packed shape (measured 4 MiB in float32, 12 MiB in bf16; with the
# rest of test_loading_memory's bf16 peak, 55.3-55.8 MiB against 55.25 planned in a quarter of
# runs on December 3, with the old code as with the new: 18 MiB).
BUILD_BYTES = 18 * 1024 * 1024


def loader_bytes(cfg: ModelConfig, s: EngineSettings) -> int:
    """What loading holds above the weights: ``BUILD_BYTES``; the buffer converting a tensor
    stored in another dtype; float layers being packed for the GEMM library, one at a time, each beside its packed
    copy until that replaces it (the largest: an untied lm_head, else the stacked gate/up);
    and when quantizing at load, the whole float tensor being quantized (the largest is the
    embeddings) with its quantizing temporaries."""
    h = cfg.hidden_size
    if s.quantization not in QUANTIZED:
        if not (s.packed and not s.quantized_weights):
            return BUILD_BYTES + CONVERT_CHUNK_BYTES
        lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
        largest_packed = max(
            lm_head, 2 * largest_mlp_width(cfg) * h, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * h
        )
        return BUILD_BYTES + CONVERT_CHUNK_BYTES + dtype_bytes(s.dtype) * largest_packed
    largest = max(cfg.vocab_size * h, largest_mlp_width(cfg) * h, cfg.num_heads * cfg.head_dim * h)
    # w8a8 quantizes a tensor stored quantized again from its float32 values
    value_bytes = 4 if s.quantization == "w8a8" else dtype_bytes(s.dtype)
    return BUILD_BYTES + CONVERT_CHUNK_BYTES + largest * value_bytes + QUANTIZE_BYTES_PER_CHUNK


# ---- one step -------------------------------------------------------------------------------


@dataclass
class StepShape:
    """What one step computes, as far as memory is concerned."""

    tokens: int
    sampled: int
    decode_groups: list[tuple[int, int, bool]] = field(default_factory=list)  # (rows, keys, padded)
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (query rows, context)
    full_sampler_rows: list[int] = field(default_factory=list)  # rows of chunks on the full path
    penalized_lengths: list[int] = field(default_factory=list)  # token counts of penalized rows
    prompt_logprob_rows: list[int] = field(default_factory=list)  # rows of prompt-logprob chunks


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture's routed experts as the checkpoint stores them, for a residency plan: their
    bytes in all, one expert's (the largest kind's), how many there are (every layer's), and the
    fewest slots the expert cache may have (``expert_slot_floor`` per kind of expert)."""

    total_bytes: int
    slot_bytes: int
    count: int
    floor: int


@dataclass(frozen=True)
class StreamableLayers:
    """A dense model's decoder layers whose matrices the checkpoint stores as the kernels read
    them, for a residency plan: each layer's bytes in a slot (``layers/layer_stream.py``), in order."""

    layer_bytes: tuple[int, ...]


def expert_slot_floor(cfg: ModelConfig, device_name: str = "cpu") -> int:
    """The fewest slots one kind of expert needs: every expert a step's layer may choose on the
    device's expert kernel's path (up to its QUANT_KERNEL_MAX_ROWS tokens, top_k each) resident
    at once."""
    assert cfg.moe is not None
    return min(cfg.moe.num_experts, backends.workspace(device_name).QUANT_KERNEL_MAX_ROWS * cfg.moe.top_k)


@dataclass(frozen=True)
class EngineSettings:
    dtype: str = "float32"
    kv_dtype: str | None = None  # default: as dtype
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's
    device: str = "cpu"  # whose workspace terms apply (``backends.workspace``): how the step runs there
    gemm_isa: str = "avx512_bf16"  # what oneDNN's bf16 GEMMs run on (machine.GEMM_ISAS): their scratch
    kernels: str = "compiled"  # "compiled" (pagedllm.kernels) or "torch": the attention and norm workspaces differ
    threads: int = 1  # torch threads: the compiled attention keeps scratch per thread
    packed: bool = True  # float weights prepacked for oneDNN (pagedllm.layers.linear): rows padded to buckets
    quantization: str | None = None  # as load_decoder takes it
    weights_bytes: int | None = None  # exact, from the checkpoint's header, when it is at hand
    quantized_weights: bool = False  # the linear layers run on quantized weights (layers/quantized.py)
    amx_tiles: bool = False  # the compiled kernels run bf16 GEMMs on AMX tiles (quantized, or their own packing)
    # the most float32 rows the compiled quantized kernel takes (any count on its AVX-512 path,
    # QUANT_FLOAT_AVX2_ROWS on AVX2); more dequantize + GEMM, as bf16 rows beyond
    # QUANT_KERNEL_MAX_ROWS do
    quant_float_max_rows: int = ANY_ROWS
    own_int8_sums: bool = False  # the compiled w8a8 op sums in its own AVX2 GEMM: no int32 sums tensor
    grammar_cache_bytes: int = 0  # structured output's compiled-grammar caches, at their bound
    disk_tier_bytes: int = 0  # the prefix cache's disk tier: its write buffer's bound and a read buffer
    # Tensor parallelism (distributed.shards): the config is one rank's; the row-parallel outputs
    # are summed across ranks (a communication buffer of their size while they are), and the
    # driver gathers every rank's logits, ``gathered_vocab`` wide, to sample from.
    tensor_parallel: int = 1
    gathered_vocab: int | None = None
    # Speculative decoding's draft model (engine.drafter): its weights, and its own KV cache of as
    # many blocks as the target's (one block of each per block of the plan). Its steps run between
    # the target's and are no larger, so the target's activation peak bounds them.
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_block: int = 0
    # A mixture whose weights may exceed the budget: its routed experts can then stay in the
    # checkpoint, a number of them resident in an expert cache (layers/expert_cache.py)
    routed_experts: RoutedExperts | None = None
    expert_slots: int | None = None  # the user's bound on the resident experts (EngineConfig.expert_slots)
    # A dense model whose weights may exceed the budget: its last decoder layers can then stay in
    # the checkpoint, read into slots each step (layers/layer_stream.py)
    streamable_layers: StreamableLayers | None = None
    resident_layers: int | None = None  # the user's bound (EngineConfig.resident_layers)
    # prefix checkpoints of the states (EngineConfig.state_checkpoints; None: costs.STATE_CHECKPOINTS_PER_SEQUENCE each)
    state_checkpoints: int | None = None

    @property
    def kv(self) -> str:
        return self.kv_dtype or self.dtype


def device(s: EngineSettings):
    """The device's own workspace terms (its GEMMs' and kernels' scratch): ``backends.workspace``."""
    return backends.workspace(s.device)


def step_buffers(shape: StepShape, block_size: int, pools: int = 1, states: bool = False) -> int:
    """The step's input (``engine.step.StepInput``), as every device receives it: token ids,
    positions and logits rows (int64), query starts and context lengths (int32), the block
    tables padded to the longest context, one per KV pool (int32), and where the model keeps
    states, each sequence's state slot (int64)."""
    seqs = sum(rows for rows, _, _ in shape.decode_groups) + len(shape.prefills)
    widest = max(
        [keys // block_size for _, keys, _ in shape.decode_groups]
        + [ceil_div(ctx, block_size) for _, ctx in shape.prefills],
        default=1,
    )
    slots = INDEX * seqs if states else 0
    return INDEX * (2 * shape.tokens + shape.sampled) + 4 * (2 * seqs + 1) + 4 * seqs * widest * pools + slots


@dataclass(frozen=True)
class LayerTerms:
    """What every phase of a decoder layer holds beside its own tensors (``live``: the step's
    buffers, the residual stream, the rotary tables and the normed input x), and the step's sizes
    and the device's terms its parts' phases read (each kind's ``footprint.phases``)."""

    cfg: ModelConfig
    s: EngineSettings
    shape: StepShape
    live: int
    gemms: Any  # the device's GEMM terms (``Gemms``: rows_of, bytes)
    norm: int  # a norm's temporaries
    allreduce: int  # what a split model's collective holds of an output

    @property
    def t(self) -> int:
        return self.shape.tokens

    @property
    def e(self) -> int:
        return dtype_bytes(self.s.dtype)

    @property
    def dev(self) -> Any:
        """The device's workspace terms (``backends.workspace``)."""
        return device(self.s)


def step_phases(cfg: ModelConfig, s: EngineSettings, shape: StepShape) -> dict[str, int]:
    """Peak live bytes of each phase of one step, above the weights and the cache.

    The step as ``DecoderLM.forward`` runs it: the embedding and the rotary tables, then each
    layer's input norm, its mixer and its feed-forward (the phases of each kind the model's layers
    are: its folder's ``footprint.phases``, ``pagedllm.kinds``), the residual add fused with the
    next norm; then the lm head, the logits and the sampler. What a phase holds beyond its inputs
    and outputs (a norm's, rotary's and attention's temporaries, a GEMM's padding and scratch, the
    attention layout's indices) depends on how the device runs it: its terms
    (``backends.workspace``), asked, never branched on here."""
    e, dev = dtype_bytes(s.dtype), device(s)
    t, n = shape.tokens, shape.sampled
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    window_sizes = {w for w in cfg.sliding_windows if w is not None}
    # a draft model's distributions at the guesses it drew (one per guessed logits row at most),
    # alive from its passes before the step to the step's sampling
    drafted = shape.sampled * (s.gathered_vocab or v) * 4 if s.draft_weights_bytes else 0
    pools = len(cfg.kv_pools)
    states = bool(cfg.state_bytes_per_sequence())
    x = step_buffers(shape, s.block_size, pools, states) + dev.layout_buffers(s, shape, window_sizes, pools)
    x += SCALAR_SLACK + drafted
    # one (cos, sin) pair per kind of rotary table: "local" beside "global" (Gemma 3's sliding layers)
    tables = (2 if cfg.local_rope is not None else 1) * 2 * t * d * e
    base = x + t * h * e + tables  # buffers, residual stream, rotary tables
    xn = th = t * h * e
    g = dev.Gemms(s)
    allreduce = t * h * e if s.tensor_parallel > 1 else 0
    layer = LayerTerms(cfg, s, shape, base + xn, g, dev.norm_transient(s, t, h), allreduce)
    head_packed = s.packed and not cfg.tie_word_embeddings  # a tied lm_head stays plain (DecoderLM.pack)
    phases = {
        "embedding": x + th + INDEX * t,
        "rotary tables": x + th + tables - 2 * t * d * e + 12 * t * d,  # the last pair in float32
        "attention norm": base + xn + layer.norm,
        "lm head": base + n * h * e + g.bytes(n, h, v, head_packed),
    }
    for kind in {part for k in cfg.layer_kinds for part in (k.mixer, k.feed_forward)}:
        for name, value in kinds.part(kind, "footprint").phases(layer).items():  # two kinds' alike: the larger
            phases[name] = max(phases.get(name, 0), value)
    head_out = g.rows_of(n, h, v, head_packed) * v * e
    sv = s.gathered_vocab or v  # the logits the sampler sees
    if s.gathered_vocab:  # every rank's logits, side by side, on the driver
        phases["logits gathered"] = base + n * h * e + head_out + n * sv * e
        head_out = n * sv * e
    if e != 4:
        phases["logits to float32"] = base + n * h * e + head_out + n * sv * 4
    return phases | _sampler_phases(shape, sv, drafted)


def _sampler_phases(shape: StepShape, sv: int, drafted: int) -> dict[str, int]:
    """After the forward pass, the sampled rows' float32 logits (``sv`` wide) and, beside them,
    the sampler's chunks on the full path, the penalties' counts, or the prompt logprobs."""
    n = shape.sampled
    logits = n * sv * 4
    sampler = max([r * sv * SAMPLER_BYTES_PER_LOGIT + INDEX * sv for r in shape.full_sampler_rows], default=0)
    penalties = max([40 * length for length in shape.penalized_lengths], default=0)
    phases = {"sampler": logits + sampler + penalties + INDEX * n + SCALAR_SLACK + drafted}
    if shape.prompt_logprob_rows:
        # a chunk's log-softmax, its top 20 at most (values and ids), one row's "more likely" mask
        prompt = max(r * sv * 4 + r * 20 * (4 + INDEX) + sv for r in shape.prompt_logprob_rows)
        phases["prompt logprobs"] = logits + prompt + INDEX * n + SCALAR_SLACK + drafted
    return phases


def step_transient_bytes(cfg: ModelConfig, s: EngineSettings, shape: StepShape) -> int:
    """Predicted peak tensor memory of one step above the weights and the cache."""
    return max(step_phases(cfg, s, shape).values())


def worst_step(
    cfg: ModelConfig, s: EngineSettings, max_batch_tokens: int, max_num_seqs: int, max_model_len: int
) -> StepShape:
    """A step shape whose every phase is at least that of any step the limits allow.

    Tokens = M; sampled rows = min(S, M), all on the full sampling path; the decode group and the
    prefill chunk that maximise the attention workspace; every sampled sequence's context as long
    as L (gather indices, padding masks).
    """
    m, seqs, ctx = max_batch_tokens, min(max_num_seqs, max_batch_tokens), max_model_len
    bs = s.block_size
    groups = device(s).worst_decode_groups(s, seqs, ctx)  # the device's tiling of decode rows
    chunks = min(seqs, SAMPLER_CHUNK_ROWS)
    shape = StepShape(
        tokens=m,
        sampled=seqs,
        decode_groups=groups,
        prefills=[(min(m, ctx), ctx)],
        full_sampler_rows=[chunks],
        penalized_lengths=[ctx],
    )
    # Index buffers of a full step: every sampled sequence gathers up to L context slots; the two
    # groups above stand for two of them.
    shape.decode_groups += [(1, _whole_blocks(ctx, bs), True)] * max(0, seqs - 2)
    return shape


def _whole_blocks(n: int, block_size: int) -> int:
    """Slots gathered for ``n`` tokens: gathers are whole blocks."""
    return ceil_div(n, block_size) * block_size


def activation_peak(
    cfg: ModelConfig, s: EngineSettings, max_batch_tokens: int, max_num_seqs: int, max_model_len: int
) -> int:
    """The worst step's tensors, plus the compiled kernels' scratch (outside torch's allocator) and
    the shared memory the ranks of a split model sum through."""
    worst = step_transient_bytes(cfg, s, worst_step(cfg, s, max_batch_tokens, max_num_seqs, max_model_len))
    return (
        worst
        + device(s).kernel_scratch_bytes(cfg, s, s.threads, max_model_len)
        + device(s).shared_memory_bytes(cfg, s, max_batch_tokens, max_num_seqs)
    )
