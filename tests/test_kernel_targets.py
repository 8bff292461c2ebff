"""The compiled kernels' other instruction-set paths are built and tested too: a machine with
AVX-512 builds them for x86-64-v3 (AVX2 and FMA, no AVX-512, no VNNI, no AMX), checks the
library holds no AVX-512 instruction, and runs the kernel-vs-PyTorch tests on that build.

Where this run's own kernels are that build already (a CPU without AVX-512, or
PAGEDLLM_KERNEL_TARGET=x86-64-v3), test_kernels.py and test_quantization.py in this run are
those tests on it: only the instruction check runs, on this run's library."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.backends.cpu.machine import cpu_flags
from pagedllm.kernels import build

TESTS = Path(__file__).parent


@pytest.mark.slow
def test_kernels_built_for_avx2_without_avx512_pass_the_kernel_tests(tmp_path):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 micro-architecture levels only")
    missing = [f for f in ("avx2", "fma", "bmi2", "movbe") if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}, which x86-64-v3 code needs")
    if build.build_target() == "x86-64-v3" or (build.build_target() == "native" and "avx512f" not in cpu_flags()):
        build.required_ops()  # this run's kernels, which its kernel tests run on
        assert_avx2_code(build.build_dir() / "pagedllm_cpu_ops.so")
        return
    env = {
        **os.environ,
        "PAGEDLLM_KERNEL_TARGET": "x86-64-v3",
        "PAGEDLLM_KERNELS": "compiled",  # a failed build fails, not falls back
        "PAGEDLLM_TEST_CACHE": str(tmp_path),  # the child suite builds its kernels here
    }
    tests = [str(TESTS / "test_kernels.py"), str(TESTS / "test_quantization.py")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=TESTS.parent,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    libraries = list(tmp_path.glob("kernels/*/pagedllm_cpu_ops.so"))
    assert len(libraries) == 1, libraries
    assert_avx2_code(libraries[0])


def assert_avx2_code(library: Path) -> None:
    if shutil.which("objdump") is None:
        pytest.skip("the tests passed on the x86-64-v3 build; objdump is missing to check its instructions")
    code = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "%zmm" not in code and "tdpbf16ps" not in code  # no AVX-512 register, no AMX tile op
    assert "%ymm" in code  # ... and it is vectorised at AVX2's width
