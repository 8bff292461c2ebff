"""The backend interface: everything the model, the KV cache and the step ask of a device.

A backend is chosen once per engine (``backends.get``) and handed to the loader, which gives it
to every layer that computes, and to the engine, which allocates the KV cache, builds the
attention metadata and sets the threads through it. No layer asks a process-wide switch which
path it is on. A backend implements every method; one whose kernel lacks a case (a layout, a
dtype) falls back to the reference PyTorch arithmetic for that call only, so one model may mix
both (``CPUTorchBackend`` is the reference; ``CPUCompiledBackend`` overrides what it compiles).

A ``cuda`` backend implements the same methods: its own attention (and metadata), its KV layout
(``kv_cache_shape``), its pointwise kernels, its weight format, its thread policy (none) and the
facts the memory planner needs (``plan_facts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..sizes import ceil_div
from .facts import PlanFacts

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..engine.step import StepInput
    from ..kinds.gated_deltanet.forward import GatedDeltaNet
    from ..kinds.sparse_moe.forward import SparseMoE
    from ..layers.quantized import QuantizedWeight
    from ..models.decoder import DecoderLM


class KVCache(Protocol):
    """A device's paged K/V cache, as the engine sees it: blocks it resizes, copies, zeroes and
    gives back; what a block holds and how attention reads it stay the device's
    (``backends.cpu.kv_cache.KVCache`` on CPU)."""

    block_size: int

    @property
    def num_blocks(self) -> int: ...  # pool 0's blocks in use

    @property
    def capacity_blocks(self) -> int: ...  # pool 0's blocks the reservation allows

    @property
    def pool_capacity(self) -> Sequence[int]: ...  # each pool's

    def copy_blocks(self, moves: list[tuple[int, int, int]]) -> None: ...  # (pool, source, destination)

    def zero_blocks(self, blocks: list[tuple[int, int]]) -> None: ...  # (pool, block)

    # a block as stored, to and from the prefix cache's disk tier (``engine.disk_prefix_cache``)
    def block_nbytes(self, pool: int) -> int: ...

    def read_block(self, pool: int, block: int) -> bytes: ...

    def write_block(self, pool: int, block: int, data: bytes | bytearray | memoryview) -> None: ...

    def resize(self, sizes: int | list[int]) -> None: ...

    def release_pages(self, pool: int, first: int) -> None: ...  # blocks from ``first`` on unused

    # the state pool beside the blocks (layers that keep a state per sequence, ``kinds.SequenceState``)
    def copy_states(self, copies: list[tuple[int, int]]) -> None: ...  # (source, destination) slots

    def restore_states(self, restores: list[tuple[int, int]]) -> None: ...  # (checkpoint, state) slots

    def resize_checkpoints(self, slots: int, moves: list[tuple[int, int]]) -> None: ...  # (old, new) slots kept


class DecodeGroupShape(Protocol):
    blocks: torch.Tensor  # [rows, blocks gathered]

    @property
    def keys(self) -> int: ...  # key slots gathered per row


class PrefillShape(Protocol):
    length: int  # query rows
    context_len: int


class AttentionLayout(Protocol):
    """Where one step's tokens read and write K/V, built once per step (``Backend.attention_metadata``)
    and read by every layer's attention. The engine reads only how the step is cut into decode
    groups and prefill chunks: the memory planner's ``StepShape`` of it."""

    @property
    def decode_groups(self) -> Sequence[DecodeGroupShape]: ...

    @property
    def prefills(self) -> Sequence[PrefillShape]: ...


def pool_tables(
    tables: list[tuple[list[int], ...]], context_lens: list[int], block_size: int, device=None
) -> torch.Tensor:
    """[pools, S, widest] int32, the step's block tables as every device receives them
    (``engine.step.StepInput.block_tables``): each sequence's blocks in each pool for its context,
    block 0 past it and where a window's pool gave a block back (``block_manager.HOLE``: never
    read by the kernel, read and masked by the PyTorch path)."""
    widest = max((ceil_div(n, block_size) for n in context_lens), default=1)
    pools = len(tables[0]) if tables else 1
    rows = [
        [_padded(seq[p], ceil_div(n, block_size), widest) for seq, n in zip(tables, context_lens)] for p in range(pools)
    ]
    if not tables:
        return torch.zeros(1, 0, 1, dtype=torch.int32, device=device)
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _padded(table: list[int], used: int, width: int) -> list[int]:
    return [max(b, 0) for b in table[:used]] + [0] * (width - used)


class Attention(Protocol):
    """One step's attention over the paged cache: writes the step's K/V, then attends.
    ``sinks``: float32 [heads], a logit per query head that joins every softmax's denominator
    and no value (gpt-oss's attention sinks)."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def sequence_states(self, layer: int) -> dict[str, torch.Tensor]:
        """A state-keeping layer's tensors by name, each [state slots, ...] (its kind's
        ``SequenceState``): the step's sequences read and write theirs at ``layout.state_slots``."""
        ...

    def state_checkpoints(self, layer: int) -> dict[str, torch.Tensor]:
        """The same tensors' checkpoint slots, [checkpoint slots, ...] each: where the states at
        ``layout.checkpoints``' positions are copied during the step."""
        ...


class DecodeProgram(Protocol):
    """A decode step's layers in one compiled call (``backends.cpu.decode_program``)."""

    def takes(self, tokens: int, sequences: int, dtype: torch.dtype, layout: Any) -> bool: ...

    def run(self, h: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], attn: Any) -> torch.Tensor: ...


class ThreadPolicy(Protocol):
    """How many threads a step runs on, and where (``backends.cpu.threads.ThreadGovernor`` on CPU)."""

    def running(self) -> Any: ...  # a context manager around one step

    def after_step(self) -> None: ...

    def share_process(self) -> None: ...  # other busy threads run beside the engine's (a server)


class Backend:
    """The interface; ``backends.cpu.torch_backend.CPUTorchBackend`` is the reference implementation."""

    name: str = "abstract"
    device: torch.device = torch.device("cpu")

    # ---- the KV cache and attention -------------------------------------------------------

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K (and V) tensor: the layout this backend's attention reads."""
        raise NotImplementedError

    def allocate_kv_cache(
        self,
        cfg: ModelConfig,
        num_blocks: int | list[int],
        block_size: int,
        dtype: torch.dtype | str,
        resident: bool,
        capacity_blocks: int | list[int] | None = None,
        state_slots: int = 0,
        checkpoint_slots: int = 0,
    ) -> KVCache:
        """``num_blocks`` in use, room for ``capacity_blocks`` (``KVCache.resize``); one number
        for every layer, or one per pool of ``cfg.kv_pools``. ``state_slots``: sequences whose
        states the state-keeping layers hold (one per sequence that may run at once); ``checkpoint_slots``:
        the states kept for prefixes (``engine.state_checkpoints``)."""
        raise NotImplementedError

    def attention_metadata(self, step: StepInput, group_size: int) -> AttentionLayout:
        """Where every token of the step reads and writes K/V, built once, read by every layer;
        how it tiles the work (the CPU's pair and gather budgets) is the device's own."""
        raise NotImplementedError

    def attention(self, kv_cache: KVCache, layout: AttentionLayout) -> Attention:
        raise NotImplementedError

    # ---- pointwise ------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``residual += x`` in place, then the norm of ``residual``."""
        raise NotImplementedError

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        raise NotImplementedError

    # ---- weights --------------------------------------------------------------------------

    def pack_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The weight in the layout this device multiplies fastest, or None to keep it as it is."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, w: QuantizedWeight, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def quantized_matmul(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        raise NotImplementedError

    def quant_kernel_takes(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether ``quantized_matmul`` of this many rows runs the packed-weight kernel (no
        dequantized copy of the layer): the compiled decode step runs only such steps."""
        return False

    def sparse_experts(
        self, moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor | None:
        """A sparse layer's chosen experts on their tokens, weighted and summed, in one call; None
        where this device has no such kernel for the layer (``moe`` then loops in PyTorch)."""
        return None

    def delta_rule_decode(
        self,
        state: torch.Tensor,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor | None:
        """A Gated DeltaNet layer's decode update: one token each of n sequences, the state of
        each ([slots, heads, key_dim, value_dim], float32) updated in place in its slot; returns
        o [n, heads, value_dim]. None where this device has no such kernel (the layer then runs
        ``delta_rule.recurrent_step`` on the gathered states)."""
        return None

    def mamba2_decode(
        self,
        state: torch.Tensor,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
    ) -> torch.Tensor | None:
        """A Mamba-2 layer's decode update, as ``delta_rule_decode`` (q = C, k = B, v = dt x, g =
        dt A); None where this device has no such kernel (``scan.recurrent_step`` then runs)."""
        return None

    def delta_rule_prefill(self, state, q, k, v, g, beta) -> torch.Tensor | None:
        """One sequence's prompt tokens through a Gated DeltaNet layer's state ([heads, key_dim,
        value_dim], float32, one slot's: updated in place): q, k [t, heads, key_dim] (normalised,
        per value head), v [t, heads, value_dim], g, beta [t, heads]; returns o [t, heads,
        value_dim]. None where this device has no such kernel (``delta_rule.chunked`` then runs)."""
        return None

    def mamba2_prefill(self, state, q, k, v, g) -> torch.Tensor | None:
        """A Mamba-2 layer's, as ``delta_rule_prefill`` without beta (q = C, k = B, v = dt x, g =
        dt A); None where this device has no such kernel (``scan.chunked`` then runs)."""
        return None

    def conv_state_step(self, conv_state, slots, x, weight, bias, silu: bool) -> torch.Tensor | None:
        """A decode step's short causal convolution for n sequences: x [n, channels] each one's new
        input, each window (``conv_state`` [slots, channels, taps - 1], float32) continued by it and
        shifted in place in its slot; returns the taps' sums [n, channels] (plus ``bias`` where not
        None, silu of them where ``silu``), float32. None where this device has no such kernel
        (the layer gathers the windows and sums in PyTorch)."""
        return None

    def gated_deltanet_decode(
        self,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        x: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        key_heads: int,
        tiled: bool,
    ) -> torch.Tensor | None:
        """A Gated DeltaNet layer's decode step between its projections for n sequences: x [n,
        channels] (each one's new convolution input), the convolution's state ([slots, channels,
        taps - 1]) and the delta rule's updated in place in their slots; returns o [n, heads,
        value_dim]. None where this device has no such kernel (the layer's PyTorch steps run)."""
        return None

    def gated_deltanet_layer_decode(self, layer: GatedDeltaNet, mixed, z, b, a, states: dict, slots):
        """A decode step's whole Gated DeltaNet ``layer`` between its projections (every row one
        sequence's token, in slot order ``slots``): its gates from b and a, the convolution and the
        rule as ``gated_deltanet_decode``, the gated norm; [n, value_heads x value_dim] float32.
        None where this device has no such kernel (the layer's steps run)."""
        return None

    def int8_matmul(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        """x @ w^T in integers (``quantization="w8a8"``): x's rows rounded to int8 per row, ``w``
        int8 per output channel; the result in x's dtype."""
        raise NotImplementedError

    # ---- sampling -------------------------------------------------------------------------

    def mask_logits(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        """Sets the tokens a grammar's bitmask forbids to -inf in ``rows`` (xgrammar's layout)."""
        raise NotImplementedError

    # ---- the machine ----------------------------------------------------------------------

    def thread_policy(self, max_threads: int | None = None, cpus: list[int] | None = None) -> ThreadPolicy:
        """A new policy for one engine; ``max_threads``: ``EngineConfig.threads``; ``cpus``: the
        cores this rank of a split model owns (its threads stay there, in a fixed number)."""
        raise NotImplementedError

    def plan_facts(self, dtype: str) -> PlanFacts:
        raise NotImplementedError

    def hold_weights(self, model: DecoderLM) -> None:
        """Told once a loaded model is about to run, so that the kernels can choose by where its
        weights will be read from (the caches or memory); nothing to choose by default."""

    def decode_program(self, model: DecoderLM) -> DecodeProgram | None:
        """The model's decode step in one compiled call (``backends.cpu.decode_program``), or None:
        the model's Python layer loop runs every step."""
        return None

    def shared_memory_ops(self) -> Any:
        """The compiled ops through which a split model's ranks on one host sum (``distributed.shm``),
        or None: the ranks then sum over torch.distributed alone."""
        return None
