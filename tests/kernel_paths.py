"""The two CPU backends side by side, to compare the compiled kernels with the PyTorch
arithmetic they replace (the ``ops`` fixture makes sure the kernels build first)."""

from pagedllm import backends


def torch_backend():
    return backends.get("cpu-torch")


def compiled_backend():
    return backends.get("cpu-compiled")


def run_with_amx_capped(script: str):
    """Runs ``script`` (Python, from the checkout's root, ``tests`` importable) in a process whose
    oneDNN cap forbids AMX, as a CPU without it runs; returns the JSON its last line prints."""
    import json
    import os
    import subprocess
    import sys

    code = "import sys; sys.path.insert(0, 'tests')\n" + script
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PAGEDLLM_KERNELS": "compiled"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
