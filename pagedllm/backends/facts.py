"""What the memory planner must know of a device, as plain values: torch-free, so ``pagedllm plan``
asks a device folder for them without loading anything (``backends.facts``), and a running
backend reports the same fields as it measured them (``Backend.plan_facts``)."""

from __future__ import annotations

from dataclasses import dataclass

ANY_ROWS = 2**63 - 1  # a kernel that takes any number of rows (the kernels' int64 maximum)


@dataclass(frozen=True)
class PlanFacts:
    """A device's answers to the planner (``memory.planner.plan_engine``)."""

    kernels: str  # "compiled" or "torch": the attention and norm workspaces differ
    gemm_kind: str | None  # what the bf16 GEMMs run on (``cpu.machine.GEMM_ISAS``); None: the CPU's flags say
    amx_tiles: bool  # the compiled kernels run bf16 GEMMs on AMX tiles (quantized weights; dense ones packed)
    device: str = "cpu"  # whose workspace terms the footprint uses (``backends.workspace``)
    quant_float_max_rows: int = ANY_ROWS  # the most float32 rows the compiled quantized kernel takes
    own_int8_sums: bool = False  # the compiled w8a8 op sums in its own AVX2 GEMM (a CPU without VNNI)
