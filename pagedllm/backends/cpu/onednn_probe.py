"""Asks oneDNN which kernel its bf16 GEMMs run on in this process: one small prepacked bf16
matmul with oneDNN's verbose log on, read back from the log line it prints.

The planner models each kind's scratch differently (``memory.footprint.gemm_scratch``), and the
CPU's flags alone can be wrong about it: ONEDNN_MAX_CPU_ISA read at oneDNN's first use, an OS
that refuses AMX state, a torch built without oneDNN. oneDNN's own report is the authority.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

# oneDNN's implementation names (the verbose log's 'exec' lines) for each kind of
# ``memory.machine.GEMM_ISAS``; a bf16 matmul that logs none ran outside oneDNN ('avx2').
_IMPLEMENTATIONS = (
    ("amx", ("_amx",)),
    ("avx512_bf16", ("avx512_core_bf16", "avx10_1_512", "avx10_2_512")),
    ("avx512", ("gemm:jit", "avx512_core")),
)


def kind_of(verbose_log: str) -> str:
    """The kind of GEMM kernel a oneDNN verbose log shows a bf16 matmul ran on."""
    for line in verbose_log.splitlines():
        fields = line.split(",")
        if len(fields) < 7 or fields[2:4] != ["primitive", "exec"] or fields[5] not in ("matmul", "inner_product"):
            continue
        implementation = fields[6]
        for kind, names in _IMPLEMENTATIONS:
            if any(name in implementation for name in names):
                return kind
        raise RuntimeError(f"oneDNN ran a bf16 matmul on an implementation pagedllm does not know: {line}")
    return "avx2"


@functools.cache
def dispatched_gemm_isa() -> str:
    """The kind of kernel oneDNN runs this process's bf16 GEMMs on, asked once. The log goes to
    the process's stdout (file descriptor 1), so that is redirected for the probe's few
    milliseconds and whatever else was printed meanwhile is passed on."""
    if not torch.backends.mkldnn.is_available():
        return "avx2"
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, 64, dtype=torch.bfloat16)
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(1)
        try:
            sys.stdout.flush()
            os.dup2(log.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                except (AttributeError, RuntimeError):  # no packing ops here: the layer's F.linear
                    F.linear(x, weight)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    others = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("onednn_verbose"))
    if others:
        os.write(1, others.encode())
    return kind_of(text)


def gemm_kind_to_plan(dtype: str) -> str | None:
    """What the planner should take the bf16 GEMMs to run on (None: let it read the CPU's
    flags). Only bf16 steps take GEMM scratch, so only they pay for the probe."""
    return dispatched_gemm_isa() if dtype == "bfloat16" else None
