"""The backend an engine is given is the one everything computes with: every layer, the KV
cache, the attention and the threads; the compiled backend falls back to the PyTorch
arithmetic for one call it has no kernel for, not for the whole model; names are checked."""

import pytest
import torch

from pagedllm import LLM, backends
from pagedllm.backends.cpu.compiled_backend import CPUCompiledBackend
from pagedllm.backends.cpu.torch_backend import CPUTorchBackend
from pagedllm.engine import LLMEngine


@pytest.mark.parametrize("name, kind", [("cpu-torch", CPUTorchBackend), ("cpu-compiled", CPUCompiledBackend)])
def test_the_chosen_backend_is_every_layers_and_the_engines(tiny_checkpoints, ops, name, kind):
    llm = LLM(tiny_checkpoints["qwen3"][0], backend=name, num_blocks=16, max_model_len=64)
    engine = llm.engine
    assert type(engine.backend) is kind and engine.backend is llm.loaded.model.backend
    holders = [m for m in llm.loaded.model.modules() if hasattr(m, "backend")]
    assert len(holders) > 10 and all(m.backend is engine.backend for m in holders)
    assert engine.runner.backend is engine.backend and engine.runner.sampler.backend is engine.backend
    assert (engine.threads._pin is not None) == (kind is CPUCompiledBackend)  # pinning is a kernel op
    assert llm.memory_plan.total_bytes > 0 and llm.generate([[5, 6, 7]])[0].token_ids


def test_the_compiled_backend_falls_back_for_one_call_only(ops, monkeypatch):
    """The grammar mask's kernel takes float32 rows: bf16 logits run xgrammar's reference
    arithmetic for that call, the next float32 call the kernel; both forbid the same tokens."""
    compiled = backends.get("cpu-compiled")
    calls = []
    monkeypatch.setattr(compiled, "ops", _Counting(compiled.ops, calls))
    vocab = 70
    bitmask = torch.tensor([[0x0000FFFF, 0x7, 0x0]], dtype=torch.int32)  # tokens 0-15 and 32-34 allowed
    allowed = [t for t in range(vocab) if t < 16 or 32 <= t < 35]
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.zeros(1, vocab, dtype=dtype)
        compiled.mask_logits(logits, bitmask, [0], vocab)
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed
        assert calls == ([] if dtype == torch.bfloat16 else ["mask_logits"])


def test_qwen3_head_norms_run_the_kernel_on_views_of_the_qkv_rows(ops, monkeypatch):
    """Qwen3's q/k norms get [T, H, D] views of the stacked q/k/v rows: the kernel takes a
    contiguous copy, and equals the reference arithmetic."""
    compiled = backends.get("cpu-compiled")
    calls = []
    monkeypatch.setattr(compiled, "ops", _Counting(compiled.ops, calls))
    weight = torch.rand(32) + 0.5
    qkv = torch.randn(5, 8 * 32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # not contiguous: rows of 8 heads, 4 of them taken
    got = compiled.rms_norm(q, weight, 1e-6)
    assert calls == ["rms_norm"] and got.shape == q.shape
    torch.testing.assert_close(got, backends.get("cpu-torch").rms_norm(q, weight, 1e-6))


class _Counting:
    def __init__(self, ops, calls):
        self._ops, self._calls = ops, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._ops, name)


@pytest.mark.serial  # torch's thread count: a worker's share of the cores would hide it
def test_threads_come_from_the_config(default_llm):
    engine = LLMEngine.of(default_llm.loaded, default_llm.config.replace(threads=1, num_blocks=8, max_model_len=128))
    try:
        assert engine.threads.max_threads == 1 and torch.get_num_threads() == 1
    finally:
        LLMEngine.of(
            default_llm.loaded, default_llm.config.replace(num_blocks=8, max_model_len=128)
        )  # back to all cores
    assert torch.get_num_threads() == engine.backend.thread_policy().max_threads


def test_unknown_and_unbuilt_backends_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="cuda.*not implemented"):
        backends.get("cuda")
    with pytest.raises(ValueError, match="choose one of auto, cpu-compiled, cpu-torch"):
        backends.get("metal")
    from pagedllm import kernels

    monkeypatch.setattr(kernels, "kernels_mode", lambda: "auto")
    monkeypatch.setattr(kernels, "compiled_ops", lambda: None)  # auto, where they cannot be built
    monkeypatch.setattr(kernels.build, "_load", _no_compiler)
    assert isinstance(backends.get(), CPUTorchBackend)  # auto: the PyTorch path
    with pytest.raises(kernels.KernelBuildError, match="no C\\+\\+ compiler"):
        backends.get("cpu-compiled")  # asked for by name: an error


def _no_compiler():
    from pagedllm.kernels import KernelBuildError

    raise KernelBuildError("no C++ compiler ('c++' not found) to build the CPU kernels")


def test_the_config_accepts_exactly_the_registrys_backends():
    """``EngineConfig`` validates ``backend`` below the registry's level, from its own list: the
    two lists are one (a new device's names must reach the command line's choices too)."""
    from pagedllm.engine_config import BACKENDS

    assert BACKENDS == backends.NAMES
