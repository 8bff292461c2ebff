"""The memory planner: what an engine costs, as a polynomial in its sizes, solved for what fits.

Pure arithmetic over a model description (``ModelConfig``, read from config.json alone) and the
engine's settings; it imports nothing from the engine and needs no weights, so it plans a 70B
model on a laptop.

The model of memory
-------------------
With N = KV-cache blocks, M = ``max_batch_tokens``, S = ``max_num_seqs``, L = ``max_model_len``::

    footprint(N, M, S) = weights + kv_block · N + activations(M, S, L) + buffers(M, S, L)

- ``weights``: every parameter times the weight dtype's size (tied embeddings counted once).
- ``kv_block = 2 · layers · block_size · kv_heads · head_dim · kv_dtype_size``: K and V of one
  block in every layer. The cache is allocated once, so this term is exact.
- ``activations``: the peak of live tensors during one step, above the weights and the cache.
  It is the largest of the step's phases (embedding, rotary tables, each sub-layer of a decoder
  layer, the final norm and logits, the sampler), each a sum of tensors whose sizes are products
  of the step's token count with the config's widths. Every phase is linear in M except:

  * attention: the CPU backend (``pagedllm.attention``) scores at most ``pairs_budget`` query ·
    key pairs per KV head at once, so its scores are bounded by a constant; what remains is the
    gathered K/V of one sequence's context, linear in L;
  * logits and sampler: logits exist only for the S sampled rows (S · vocab · 4 bytes), and the
    sampler works on chunks of 8 rows, so its workspace is a constant (≈ 25 · 8 · vocab bytes).

- ``buffers``: the step's index tensors (token ids, positions, slot mapping: 8 bytes each per
  token; 8 bytes per context block gathered; a 1-byte padding mask per (decode row, key slot),
  which is bilinear in S and L: the one bilinear term, bounded by S · L).
- On bf16, oneDNN's GEMM kernels take a scratch buffer from torch's allocator; measured on this
  torch build, it is at most ``128 · (2 · min(K, 512) + 17 + 4 · (min(rows, 256) - 1))`` bytes
  (+128 KiB for K > 1024) for a [rows, K] input. On fp32 there is none.

``step_transient_bytes`` predicts the peak of one concrete step (its shape: tokens, sampled
rows, decode groups, prefill chunks); ``activation_peak`` is its maximum over every step the
limits allow, which is what the planner reserves. Both are checked against measured peaks.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from .config import ModelConfig

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
INDEX = 8  # int64
DEFAULT_PAIRS_BUDGET = 1 << 18  # must match pagedllm.attention.DEFAULT_PAIRS_BUDGET
DEFAULT_GATHER_BUDGET = 8192  # must match pagedllm.attention.DEFAULT_GATHER_BUDGET
SAMPLER_CHUNK_ROWS = 8  # must match pagedllm.sampler.CHUNK_ROWS
SAMPLER_BYTES_PER_LOGIT = 25  # full sampling path: float32 copies, int64 sort order, masks
SCALAR_SLACK = 256  # one-element temporaries (eps, scale factors) that ops create on the way
# Kept out of the cache for what the model above does not itemise: per-request Python state,
# tokenizer buffers, allocator rounding.
FIXED_BYTES = 16 * 1024**2
# CPU throughput vs max_batch_tokens flattens out by 512 tokens per step on this class of
# machine (docs/memory.md has the sweep); larger steps only cost memory.
AUTO_MAX_BATCH_TOKENS = 512
AUTO_MAX_NUM_SEQS = 64


def dtype_bytes(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    return DTYPE_BYTES[name]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype) -> int:
    """Bytes one block costs across all layers, K and V. The only place this is computed."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(kv_dtype)


def parameter_count(cfg: ModelConfig) -> int:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    per_layer = h * dq + 2 * h * dk + dq * h + 3 * h * i + 2 * h
    per_layer += (dq + 2 * dk) * cfg.qkv_bias + h * cfg.o_bias + (2 * i + h) * cfg.mlp_bias
    per_layer += 2 * d * cfg.qk_norm
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_layers * per_layer + h


def weight_bytes(cfg: ModelConfig, dtype) -> int:
    return parameter_count(cfg) * dtype_bytes(dtype)


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


@dataclass(frozen=True)
class EngineSettings:
    dtype: str = "float32"
    kv_dtype: str | None = None  # default: as dtype
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's
    pairs_budget: int = DEFAULT_PAIRS_BUDGET
    gather_budget: int = DEFAULT_GATHER_BUDGET

    @property
    def kv(self) -> str:
        return self.kv_dtype or self.dtype


def gemm_scratch(rows: int, k: int, dtype: str) -> int:
    """oneDNN's bf16 GEMM scratch for a [rows, k] input (none on fp32)."""
    if dtype_bytes(dtype) == 4 or rows == 0 or k < 32:
        return 0
    return 128 * (2 * min(k, 512) + 17 + 4 * (min(rows, 256) - 1)) + (131072 if k > 1024 else 0)


def _norm_transient(rows: int, width: int, e: int) -> int:
    """RMSNorm's temporaries above its input (HF's float32 formulation)."""
    return rows * width * (4 if e == 4 else 8) + 4 * rows


def _softmax_bytes(pairs: int, e: int) -> int:
    """scores (activation dtype) + float32 softmax output (+ float32 input copy on bf16)."""
    return pairs * (e + 4 + (0 if e == 4 else 4))


def _per_head(rows: int, keys: int, g: int, d: int, e: int, query_copy: bool) -> int:
    """Peak of one KV head's matmul / softmax / matmul over ``rows`` query rows of ``g`` heads."""
    pairs = rows * g * keys
    return max(pairs * e + (rows * g * d * e if query_copy else 0),  # q @ k^T
               _softmax_bytes(pairs, e),  # softmax in float32
               pairs * e + rows * g * d * e)  # probs @ v


def _attention_workspace(cfg: ModelConfig, s: EngineSettings, shape: StepShape, windowed: bool) -> int:
    """Largest live workspace of one attention call (one decode group or one prefill tile)."""
    e, kv_e = dtype_bytes(s.dtype), dtype_bytes(s.kv)
    g, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    worst = 0
    for rows, keys, _ in shape.decode_groups:  # keys: gathered slots per row, whole blocks
        gathered = 2 * rows * keys * dk * kv_e + rows * dq * e  # K, V, the group's queries
        mask = 2 * rows * keys + INDEX * (keys + rows) if windowed else 0  # a window's mask, built once
        worst = max(worst, gathered + mask + _per_head(rows, keys, g, d, e, query_copy=False))
    for q_rows, ctx in shape.prefills:
        tile = min(q_rows, max(1, s.pairs_budget // (g * ctx)))
        padded = -(-ctx // s.block_size) * s.block_size
        build = INDEX * (tile + ctx) + tile * ctx + (tile * ctx + INDEX * tile if windowed else 0)
        body = tile * ctx + _per_head(tile, ctx, g, d, e, query_copy=True)
        worst = max(worst, 2 * padded * dk * kv_e + max(build, body))
    return worst


def step_buffers(shape: StepShape, block_size: int, windows: set[int] = frozenset()) -> int:
    """Index tensors built for the step: ids, positions, slots, logit rows, the block ids of
    every context, and the decode masks (padding; one per sliding window shorter than the
    group's context)."""
    total = INDEX * (3 * shape.tokens + shape.sampled)
    for rows, keys, _ in shape.decode_groups:
        total += INDEX * (rows * (keys // block_size) + 2 * rows) + rows * keys
        total += rows * keys * sum(1 for w in windows if w < keys)
    total += sum(INDEX * -(-ctx // block_size) for _, ctx in shape.prefills)
    return total


def step_phases(cfg: ModelConfig, s: EngineSettings, shape: StepShape) -> dict[str, int]:
    """Peak live bytes of each phase of one step, above the weights and the cache."""
    e = dtype_bytes(s.dtype)
    t, n = shape.tokens, shape.sampled
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    dq, dk = cfg.num_heads * d, cfg.num_kv_heads * d
    window_sizes = {w for w in cfg.sliding_windows if w is not None}
    windows = bool(window_sizes)
    x = step_buffers(shape, s.block_size, window_sizes) + SCALAR_SLACK
    base = x + t * h * e + 2 * t * d * e  # buffers, residual stream, rotary tables
    xn, qkv = t * h * e, t * (dq + 2 * dk) * e
    phases = {
        "embedding": x + t * h * e + INDEX * t,
        "rotary tables": x + t * h * e + 12 * t * d,
        "attention norm": base + _norm_transient(t, h, e),
        "q/k/v projections": base + xn + qkv + gemm_scratch(t, h, s.dtype),
        "rotary": base + xn + qkv + t * dq * e,
        "attention": base + xn + qkv + t * dq * e + _attention_workspace(cfg, s, shape, windows),
        "output projection": base + xn + t * dq * e + t * h * e + gemm_scratch(t, dq, s.dtype),
        "mlp gate/up": base + xn + 2 * t * i * e + gemm_scratch(t, h, s.dtype),
        "mlp down": base + xn + t * i * e + t * h * e + gemm_scratch(t, i, s.dtype),
        "lm head": base + n * h * e + n * v * e + gemm_scratch(n, h, s.dtype),
    }
    if e != 4:
        phases["logits to float32"] = base + n * h * e + n * v * (e + 4)
    if cfg.qk_norm:
        # q's norm, then k's while q's result is alive; the inputs die after both
        phases["q/k norm"] = base + xn + qkv + max(
            _norm_transient(t * cfg.num_heads, d, e),
            t * dq * e + _norm_transient(t * cfg.num_kv_heads, d, e))
    logits = n * v * 4
    sampler = max([r * v * SAMPLER_BYTES_PER_LOGIT + INDEX * v for r in shape.full_sampler_rows], default=0)
    penalties = max([40 * length for length in shape.penalized_lengths], default=0)
    phases["sampler"] = logits + sampler + penalties + INDEX * n + SCALAR_SLACK
    return phases


def step_transient_bytes(cfg: ModelConfig, s: EngineSettings, shape: StepShape) -> int:
    """Predicted peak tensor memory of one step above the weights and the cache."""
    return max(step_phases(cfg, s, shape).values())


def worst_step(cfg: ModelConfig, s: EngineSettings, max_batch_tokens: int, max_num_seqs: int,
               max_model_len: int) -> StepShape:
    """A step shape whose every phase is at least that of any step the limits allow.

    Tokens = M; sampled rows = min(S, M), all on the full sampling path; the decode group and the
    prefill chunk that maximise the attention workspace; every sampled sequence's context as long
    as L (gather indices, padding masks).
    """
    m, seqs, ctx = max_batch_tokens, min(max_num_seqs, max_batch_tokens), max_model_len
    # Decode groups: many short rows filling the gather budget, or one row of the longest context.
    bs = s.block_size
    whole = lambda n: -(-n // bs) * bs  # noqa: E731  (gathers are whole blocks)
    rows = max(1, min(seqs, s.gather_budget // bs))
    groups = [(rows, max(bs, min(whole(ctx), s.gather_budget // rows // bs * bs)), True), (1, whole(ctx), True)]
    chunks = min(seqs, SAMPLER_CHUNK_ROWS)
    shape = StepShape(tokens=m, sampled=seqs, decode_groups=groups, prefills=[(min(m, ctx), ctx)],
                      full_sampler_rows=[chunks], penalized_lengths=[ctx])
    # Index buffers of a full step: every sampled sequence gathers up to L context slots; the two
    # groups above stand for two of them.
    shape.decode_groups += [(1, whole(ctx), True)] * max(0, seqs - 2)
    return shape


def activation_peak(cfg: ModelConfig, s: EngineSettings, max_batch_tokens: int, max_num_seqs: int,
                    max_model_len: int) -> int:
    return step_transient_bytes(cfg, s, worst_step(cfg, s, max_batch_tokens, max_num_seqs, max_model_len))


# ---- the plan ---------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    model: str
    budget_bytes: int
    budget_source: str
    num_blocks: int
    block_size: int
    max_batch_tokens: int
    max_num_seqs: int
    max_model_len: int
    dtype: str
    kv_dtype: str
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_block: int
    activation_bytes: int
    fixed_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.fixed_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks // -(-self.max_model_len // self.block_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(total_bytes=self.total_bytes, headroom_bytes=self.headroom_bytes,
                 cache_tokens=self.cache_tokens, full_length_requests=self.full_length_requests)
        return d

    def table(self) -> str:
        gib = lambda b: f"{b / GiB:8.3f} GiB"  # noqa: E731
        rows = [
            ("model", self.model),
            ("budget", f"{gib(self.budget_bytes)}  ({self.budget_source})"),
            ("weights", f"{gib(self.weights_bytes)}  ({self.dtype})"),
            ("KV cache", f"{gib(self.kv_cache_bytes)}  ({self.num_blocks} blocks x {self.block_size} tokens = "
                         f"{self.cache_tokens} tokens, {self.full_length_requests} requests of "
                         f"{self.max_model_len} tokens; {self.kv_dtype})"),
            ("activation peak", f"{gib(self.activation_bytes)}  (max_batch_tokens={self.max_batch_tokens}, "
                                f"max_num_seqs={self.max_num_seqs})"),
            ("fixed", gib(self.fixed_bytes)),
            ("total", gib(self.total_bytes)),
            ("headroom", gib(self.headroom_bytes)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class CacheDoesNotFitError(MemoryError):
    """The requested engine does not fit the memory budget; says what does."""

    def __init__(self, message: str, breakdown: dict, suggestions: dict):
        super().__init__(message)
        self.breakdown = breakdown
        self.suggestions = suggestions


def plan(cfg: ModelConfig, budget_bytes: int, *, budget_source: str = "given", model_name: str = "model",
         settings: EngineSettings = EngineSettings(), num_blocks: int | None = None,
         max_batch_tokens: int | None = None, max_num_seqs: int | None = None,
         cap_blocks: int | None = None) -> MemoryPlan:
    """Solves for what the user left unset; raises CacheDoesNotFitError if nothing fits.

    Neither N nor M: M = AUTO_MAX_BATCH_TOKENS (or the largest that fits), the rest to N.
    N set: the largest M. M set: the largest N. Both: check. Results are integers, rounded down,
    never above the budget, and maximal: one more block or one more token would not fit.
    ``cap_blocks`` bounds a solved N (blocks beyond what can ever be used at once are waste).
    """
    s = settings
    max_len = min(s.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    seqs = max_num_seqs or AUTO_MAX_NUM_SEQS
    weights = weight_bytes(cfg, s.dtype)
    per_block = kv_bytes_per_block(cfg, s.block_size, s.kv)
    min_blocks = -(-max_len // s.block_size)  # one request of max_model_len must fit

    def act(m: int) -> int:
        return activation_peak(cfg, s, m, seqs, max_len)

    def fixed_for(m: int) -> int:
        return weights + act(m) + FIXED_BYTES

    def largest_m(blocks: int, cap: int) -> int:
        """Largest M in [1, cap] with fixed_for(M) + blocks * per_block <= budget (0 if none)."""
        room = budget_bytes - blocks * per_block
        if fixed_for(1) > room:
            return 0
        lo, hi = 1, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fixed_for(mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def largest_n(m: int) -> int:
        return max(0, (budget_bytes - fixed_for(m)) // per_block)

    context = dict(cfg=cfg, s=s, budget=budget_bytes, source=budget_source, weights=weights,
                   per_block=per_block, max_len=max_len, seqs=seqs, act=act, largest_m=largest_m,
                   largest_n=largest_n, min_blocks=min_blocks)
    if weights + FIXED_BYTES > budget_bytes:
        _raise(context, "the weights alone exceed the budget", num_blocks, max_batch_tokens or 1)
    cap = cap_blocks if cap_blocks is not None else 1 << 62
    if num_blocks is None and max_batch_tokens is None:
        m = largest_m(min_blocks, AUTO_MAX_BATCH_TOKENS)
        if m == 0:  # not even one full-length request fits, whatever the step size
            n = largest_n(1)
            _raise(context, f"the KV cache that fits ({n} blocks x {s.block_size} = {n * s.block_size} tokens) "
                            f"cannot hold one request of max_model_len={max_len} tokens ({min_blocks} blocks): "
                            f"set max_model_len <= {n * s.block_size}, or give more memory",
                   None, AUTO_MAX_BATCH_TOKENS, {"max_model_len": n * s.block_size})
        n = min(cap, largest_n(m))
    elif num_blocks is None:
        m, n = max_batch_tokens, min(cap, largest_n(max_batch_tokens))
    elif max_batch_tokens is None:
        n, m = num_blocks, largest_m(num_blocks, max(1, budget_bytes))
        if m == 0:
            _raise(context, f"num_blocks={num_blocks} leaves no room for even one token per step", n, 1)
    else:
        n, m = num_blocks, max_batch_tokens
    if fixed_for(m) + n * per_block > budget_bytes:
        _raise(context, "the requested sizes exceed the budget", n, m)
    if n < min_blocks:
        _raise(context, f"the KV cache ({n} blocks x {s.block_size} = {n * s.block_size} tokens) cannot hold "
                        f"one request of max_model_len={max_len} tokens ({min_blocks} blocks): set "
                        f"max_model_len <= {n * s.block_size}, or num_blocks >= {min_blocks}", num_blocks, m,
               {"max_model_len": n * s.block_size})
    return MemoryPlan(model_name, budget_bytes, budget_source, n, s.block_size, m, seqs, max_len,
                      s.dtype, s.kv, weights, n * per_block, per_block, act(m), FIXED_BYTES)


def _raise(c: dict, reason: str, num_blocks: int | None, m: int, extra: dict | None = None) -> None:
    gib = lambda b: f"{b / GiB:.3f} GiB"  # noqa: E731
    per_block, budget, max_len, s = c["per_block"], c["budget"], c["max_len"], c["s"]
    n = max(num_blocks if num_blocks is not None else 0, c["min_blocks"])
    act = c["act"](m)
    need = c["weights"] + n * per_block + act + FIXED_BYTES
    breakdown = {"weights": c["weights"], "kv_cache": n * per_block, "activations": act,
                 "fixed": FIXED_BYTES, "total": need, "budget": budget}
    suggestions: dict = dict(extra or {})
    lines = [f"{reason}.",
             f"  needs {gib(need)}: weights {gib(c['weights'])} ({s.dtype}) + KV cache {gib(n * per_block)} "
             f"({n} blocks x {s.block_size} tokens) + activations {gib(act)} (max_batch_tokens={m}, "
             f"max_num_seqs={c['seqs']}) + fixed {gib(FIXED_BYTES)}",
             f"  budget: {gib(budget)} ({c['source']})"]
    if c["weights"] + FIXED_BYTES <= budget and num_blocks is not None:
        best_m = c["largest_m"](num_blocks, max(m, 1) * 64)
        if best_m:
            suggestions["max_batch_tokens"] = best_m
            lines.append(f"  largest max_batch_tokens that fits with num_blocks={num_blocks}: {best_m}")
    if c["weights"] + FIXED_BYTES <= budget:
        best_n = c["largest_n"](m)
        if best_n:
            suggestions["num_blocks"] = best_n
            fits_len = best_n * s.block_size
            lines.append(f"  largest num_blocks that fits with max_batch_tokens={m}: {best_n} "
                         f"({fits_len} tokens{'' if fits_len >= max_len else f'; max_model_len must be <= {fits_len}'})")
            if best_n < c["min_blocks"]:
                suggestions.setdefault("max_model_len", fits_len)
    suggestions["memory_bytes"] = need
    lines.append(f"  smallest memory that fits (num_blocks={n}, max_batch_tokens={m}): {gib(need)}")
    levers = []
    if dtype_bytes(s.kv) == 4:
        levers.append("a bfloat16 KV cache (kv_cache_dtype='bfloat16') halves the cache")
    if dtype_bytes(s.dtype) == 4:
        levers.append("dtype='bfloat16' halves the weights")
    levers.append("a smaller max_model_len shrinks the smallest cache and the gather buffers")
    levers.append("block_size does not change bytes per token, only the rounding")
    lines.append("  other levers: " + "; ".join(levers))
    raise CacheDoesNotFitError("\n".join(lines), breakdown, suggestions)


# ---- the budget -------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_memory(text: str | int) -> int:
    """'6GiB', '512MiB', '8GB', '1.5 GiB' or a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory {text!r}: expected a size like '6GiB', '512MiB' or '8GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def free_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes free now, where that figure came from)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, "torch.cuda.mem_get_info"
    candidates = []
    host = _meminfo_available()
    if host is not None:
        candidates.append((host, "host MemAvailable"))
    cgroup = _cgroup_free()
    if cgroup is not None:
        candidates.append(cgroup)
    if not candidates:
        raise RuntimeError("cannot tell how much memory is free: no /proc/meminfo and no cgroup limit")
    return min(candidates)


def _meminfo_available() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return None if text in ("max", "") else int(text)


def _cgroup_free(root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """Container limit minus current usage: cgroup v2, else v1."""
    limit, usage = _read_int(f"{root}/memory.max"), _read_int(f"{root}/memory.current")
    if limit is not None and usage is not None:
        return max(0, limit - usage), "cgroup v2 memory.max - memory.current"
    limit, usage = _read_int(f"{root}/memory/memory.limit_in_bytes"), _read_int(f"{root}/memory/memory.usage_in_bytes")
    if limit is not None and usage is not None and limit < (1 << 60):
        return max(0, limit - usage), "cgroup v1 memory.limit_in_bytes - memory.usage_in_bytes"
    return None


def resolve_budget(memory: str | int | None, memory_fraction: float | None, device: str = "cpu",
                   already_used: int = 0) -> tuple[int, str]:
    """The engine's whole budget in bytes, and a phrase saying where it came from.

    ``already_used``: bytes the engine itself already holds (e.g. loaded weights), added back to
    the free figure so a fraction means a fraction of what was free before the engine started.
    """
    if memory is not None and memory_fraction is not None:
        raise ValueError("give memory or memory_fraction, not both")
    if memory is not None:
        return parse_memory(memory), f"memory={memory}"
    fraction = 0.9 if memory_fraction is None else memory_fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
    free, source = free_memory(device)
    free += already_used
    return int(free * fraction), f"{fraction:g} x {free / GiB:.2f} GiB free ({source})"


def plan_engine(cfg: ModelConfig, *, model_name: str = "model", dtype: str = "float32",
                kv_cache_dtype: str | None = None, block_size: int = 16, num_blocks: int | None = None,
                max_batch_tokens: int | None = None, max_num_seqs: int | None = None,
                max_model_len: int | None = None, memory: str | int | None = None,
                memory_fraction: float | None = None, device: str = "cpu",
                already_loaded: int = 0) -> MemoryPlan:
    """The plan an engine starts from: the budget (given, or a fraction of what is free), then
    ``plan``. With no budget given, a solved cache is capped at what ``max_num_seqs`` requests of
    ``max_model_len`` tokens can use at once, so a small model does not reserve the whole host."""
    budget, source = resolve_budget(memory, memory_fraction, device, already_loaded)
    settings = EngineSettings(dtype=dtype, kv_dtype=kv_cache_dtype, block_size=block_size,
                              max_model_len=max_model_len)
    max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    seqs = max_num_seqs or AUTO_MAX_NUM_SEQS
    cap = seqs * -(-max_len // block_size) if memory is None and memory_fraction is None else None
    return plan(cfg, budget, budget_source=source, model_name=model_name, settings=settings,
                num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, max_num_seqs=seqs,
                cap_blocks=cap)
