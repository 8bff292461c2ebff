"""The planner follows the kind of bf16 GEMM kernel the process really runs (AMX, AVX512-BF16,
AVX-512 without bf16, none on AVX2): the kind read from the CPU's flags is the one oneDNN
reports it dispatched, the compiled AMX kernels obey the same switch as oneDNN, and the memory
grid holds on every kind this machine can run. A machine runs any kind below its own by
ONEDNN_MAX_CPU_ISA (oneDNN reads it once, so each kind gets its own process); kinds above it are
skipped, naming the flags it lacks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.backends.cpu import machine
from pagedllm.backends.facts import PlanFacts
from pagedllm.config import ModelConfig
from pagedllm.engine_config import EngineConfig
from pagedllm.memory.footprint import EngineSettings, activation_peak, step_phases, worst_step
from pagedllm.memory.machine import usable_cpus
from pagedllm.memory.planner import plan_engine

# The cap that runs each kind on a machine that has a better one (oneDNN's names).
CAP = {"amx": "DEFAULT", "avx512_bf16": "AVX512_CORE_BF16", "avx512": "AVX512_CORE", "avx2": "AVX2"}
TESTS = Path(__file__).parent


def runnable(kind: str) -> None:
    """Skips unless this machine can run ``kind``: its CPU has the flags, its OS grants them."""
    missing = machine.missing_flags(kind)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags), which {kind} GEMMs need")
    if kind == "amx" and not machine._os_grants_amx():
        pytest.skip("the OS refuses this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")


def child_env(kind: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    return {**env, "ONEDNN_MAX_CPU_ISA": CAP[kind]}


PROBE = """
import json, torch
from pagedllm.backends.cpu.machine import gemm_isa
from pagedllm.backends.cpu.onednn_probe import dispatched_gemm_isa
from pagedllm import backends
from pagedllm.layers import quantized as Q
g = torch.Generator().manual_seed(0)
backend = backends.get()
w = Q.QuantizedWeight(torch.randint(0, 256, (48, 256), generator=g, dtype=torch.uint8),
                      torch.rand(48, 16, generator=g) / 50, None, 4, 32)
x = torch.randn(17, 512, generator=g)
exact = x @ Q.dequantize_reference(w, torch.float32).T
got = backend.quantized_matmul(x.bfloat16(), w).float()
print(json.dumps(dict(flags=gemm_isa(), onednn=dispatched_gemm_isa(), compiled=backend.name == "cpu-compiled",
                      tiles=getattr(backend, "amx_tiles", False), error=float((got - exact).norm() / exact.norm()))))
"""


@pytest.mark.parametrize("kind", machine.GEMM_ISAS)
def test_the_kind_read_from_cpu_flags_is_the_one_onednn_runs_and_amx_kernels_obey_its_switch(kind):
    runnable(kind)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=child_env(kind)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["onednn"] == kind  # oneDNN's own log: the cap ran the kind asked for
    assert seen["flags"] == kind  # ... and the planner's torch-free reading agrees
    # the compiled kernels run bf16 rows on AMX tiles exactly when oneDNN may use AMX
    assert seen["tiles"] == (kind == "amx" and seen["compiled"])
    assert seen["error"] < 0.01  # 17 bf16 rows: the tiles, or the dequantize + GEMM fallback


def fake_cpu(monkeypatch, flags: set[str], amx_granted: bool = True, cap: str | None = None) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(machine, "_os_grants_amx", lambda: amx_granted)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    machine.gemm_isa.cache_clear()


AVX512 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
FLAGS = {
    "amx": SAPPHIRE_RAPIDS,
    "avx512_bf16": AVX512 | {"avx512_bf16", "avx512_vnni"},
    "avx512": AVX512 | {"avx512_vnni"},
    "avx2": {"avx", "avx2", "fma"},
}


def test_the_planner_reserves_the_scratch_of_the_kind_it_detects(monkeypatch):
    """With each kind's flags faked, detection names that kind and the plan's activations are
    those the footprint model gives for it; the four kinds' GEMM phases differ."""
    cfg = ModelConfig.from_file(TESTS.parent / "benchmarks/configs/llama-3-70b.json")
    try:
        gate_up = {}
        for kind, flags in FLAGS.items():
            fake_cpu(monkeypatch, flags)
            assert machine.gemm_isa() == kind
            facts = PlanFacts(kernels="torch", gemm_kind=None, amx_tiles=False)  # the kind: from the flags
            asked = EngineConfig(dtype="bfloat16", memory="200GiB", max_model_len=4096)
            plan = plan_engine(cfg, asked, backend=facts)
            settings = EngineSettings(
                dtype="bfloat16",
                max_model_len=4096,
                gemm_isa=kind,
                kernels="torch",
                threads=usable_cpus(),
                packed=kind != "avx2",  # oneDNN packs no bf16 weights on AVX2
            )
            assert plan.activation_bytes == activation_peak(
                cfg, settings, plan.max_batch_tokens, plan.max_num_seqs, 4096
            )
            shape = worst_step(cfg, settings, plan.max_batch_tokens, plan.max_num_seqs, 4096)
            gate_up[kind] = step_phases(cfg, settings, shape)["mlp gate/up"]
        assert len(set(gate_up.values())) == 4, gate_up  # each kind's GEMM scratch differs
    finally:
        machine.gemm_isa.cache_clear()


@pytest.mark.parametrize(
    "flags, granted, cap, kind",
    [
        (SAPPHIRE_RAPIDS, False, None, "avx512_bf16"),  # a sandbox that refuses AMX state
        (SAPPHIRE_RAPIDS, True, "AVX512_CORE_BF16", "avx512_bf16"),
        (SAPPHIRE_RAPIDS, True, "avx512_core", "avx512"),  # oneDNN reads the value in any case
        (SAPPHIRE_RAPIDS, True, "AVX2", "avx2"),
        (SAPPHIRE_RAPIDS, True, "AVX10_1_512_AMX", "amx"),
        (FLAGS["avx512"], True, "AVX512_CORE_AMX", "avx512"),  # a cap never raises the kind
        (FLAGS["avx512_bf16"], True, "DEFAULT", "avx512_bf16"),
    ],
)
def test_os_refusal_and_onednn_cap_lower_the_detected_kind(monkeypatch, flags, granted, cap, kind):
    try:
        fake_cpu(monkeypatch, flags, granted, cap)
        assert machine.gemm_isa() == kind
    finally:
        machine.gemm_isa.cache_clear()


# Two grids that take each GEMM path: packed layers beside a tied lm_head on plain weights
# (llama3-rope-tied); dequantized int4 chunks, q/k norms and an 8-bit KV cache (qwen3).
GRIDS = [("llama3-rope-tied", None, None), ("qwen3", "int4", "int8")]

CHILD = """
import sys
sys.path.insert(0, {tests!r})
from memory_grid import check_grids
check_grids({grids!r})
"""


@pytest.mark.slow
@pytest.mark.serial  # measured peaks, torch's thread count in the GEMM scratch: alone
@pytest.mark.parametrize("kind", machine.GEMM_ISAS)
def test_step_memory_prediction_holds_on_each_kind_of_gemm_kernel(tiny_checkpoints, kind):
    runnable(kind)
    grids = [(str(tiny_checkpoints[arch][0]), q, kv) for arch, q, kv in GRIDS]
    if kind == machine.gemm_isa():  # this process's own kind
        pytest.skip(
            "this process's own kind: test_memory_planner.py runs these two grids here "
            "(on_tiny_models[llama3-rope-tied-bfloat16], covers_quantized_weights_and_kv_cache[int4-int8-bfloat16])"
        )
    code = CHILD.format(tests=str(TESTS), grids=grids)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=child_env(kind))
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]


def test_torch_runs_on_the_kind_this_process_detects():
    """The in-process pair of the child checks above (no cap set by the test)."""
    from pagedllm.backends.cpu.onednn_probe import dispatched_gemm_isa

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    assert dispatched_gemm_isa() == machine.gemm_isa()


def scratch_taken(x: torch.Tensor, weight: torch.Tensor, packed: bool) -> int:
    """Bytes one bf16 GEMM takes from torch's allocator beyond its output (warmed up first)."""
    import torch.nn.functional as F

    from pagedllm.memory.tracker import track_peak

    if packed:
        w = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        call = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    else:
        call = lambda: F.linear(x, weight)  # noqa: E731
    call()
    with track_peak() as m:
        call()
    return m.peak_bytes - x.shape[0] * weight.shape[0] * 2


@pytest.mark.serial  # measured scratch
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_gemm_scratch_bounds_what_onednn_takes_at_each_thread_count(threads):
    """One bf16 GEMM at a time on this process's kind of kernel: never above ``gemm_scratch``
    for torch's thread count (more threads than cores take the same memory, so 4 is measurable
    on 2 cores; the grids run 2); on AVX512-BF16 with prepacked weights whose 64-column blocks
    divide among the threads, exactly it."""
    from pagedllm.backends.cpu.workspace import gemm_scratch

    kind, previous = machine.gemm_isa(), torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    torch.set_num_threads(threads)
    try:
        # (1536, 320): oneDNN's blocked weight copy from 33 rows; (64, 49152): all of it at 384
        for k, n in [(64, 576), (576, 3072), (1536, 64), (1536, 320), (64, 49152)]:
            weight = torch.randn(n, k, generator=g).bfloat16()
            for rows in [1, 16, 33, 256, 384, 513]:
                x = torch.randn(rows, k, generator=g).bfloat16()
                for packed in [False, True] if kind != "avx2" else [False]:
                    taken, bound = (
                        scratch_taken(x, weight, packed),
                        gemm_scratch(rows, k, n, "bfloat16", kind, packed, threads),
                    )
                    shape = (kind, threads, rows, k, n, "packed" if packed else "plain")
                    assert taken <= bound, (shape, taken, bound)
                    if kind == "avx512_bf16" and packed and (n // 64) % threads == 0:
                        assert taken == bound, (shape, taken, bound)
    finally:
        torch.set_num_threads(previous)
