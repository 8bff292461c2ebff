"""``pagedllm bench --matrix``: every quantization a user can pick against the peers at hand, on one
request and on a batch of prompts, on this machine, in one command (issue 52).

A user choosing a lower precision to go faster needs to know, for the CPU in front of them,
whether it does: one figure per (quantization, workload), each engine in its own process one at
a time (``run.main``, once per workload), then one table: output tok/s, the ratio to float32 in
the same run, and the ratio to the best peer row of that workload. Printed, and with
``--matrix-doc FILE`` written into that Markdown file between two markers (a later run replaces
its section; a run under emulation keeps a section of its own). The table carries the CPU's
flags, its L3 and what stood in for another kind of CPU (``PAGEDLLM_KERNEL_TARGET``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``): a figure measured under them is emulated,
and says so.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import env
from . import run
from .host import machine

# (dtype, quantization) of the pagedllm rows: float32 and bf16 dense, then the model as stored and
# each load-time quantization, with float32 activations and with bf16 ones (other kernels: bf16
# rows are rounded to 8 bits per 32 columns and multiplied in integers)
MATRIX_VARIANTS = ("float32:none", "bfloat16:none") + tuple(
    f"{dtype}:{quantization}"
    for dtype in ("float32", "bfloat16")
    for quantization in ("stored", "int8", "int4", "w8a8")
)
# variables that make this machine stand in for a smaller kind of CPU, and their values that do not
EMULATION_VARIABLES = (
    (env.KERNEL_TARGET, "native"),
    (env.ONEDNN_MAX_CPU_ISA, ""),
    (env.DNNL_MAX_CPU_ISA, ""),
    (env.MKL_ENABLE_INSTRUCTIONS, ""),
)


def workloads(args) -> list[tuple[str, int]]:
    """(workload, prompts): one request, and ``--num-prompts`` at once (64 unless given)."""
    return [("single", 1), ("standard", args.num_prompts)]


def installed_peers(args) -> list[str]:
    """``--compare``, else the peers this machine has: llama.cpp where ``--llama-python`` (or this
    interpreter) imports llama_cpp, vLLM where ``--vllm-python`` is given."""
    if args.compare:
        return [p for p in args.compare.split(",") if p]
    peers = []
    python = args.llama_python or sys.executable
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=120)
    if probe.returncode == 0:
        peers.append("llama.cpp")
    if args.vllm_python and Path(args.vllm_python).exists():
        peers.append("vllm")
    return peers


def emulation() -> str:
    """What stands in for another kind of CPU in this run ("" where nothing does)."""
    return ", ".join(f"{var.name}={var.get()}" for var, native in EMULATION_VARIABLES if var.get() != native)


def l3_size() -> str:
    """The L3 as ``lscpu`` reports it (a model larger than it is what a decode step reads from memory)."""
    if shutil.which("lscpu") is None:
        return "unknown"
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("L3")), "unknown")


def markers(emulated: str) -> tuple[str, str]:
    """The section's first and last lines: one section for the machine as it is, one per emulation."""
    kind = f" ({emulated})" if emulated else ""
    return f"<!-- pagedllm bench --matrix{kind}: begin -->", f"<!-- pagedllm bench --matrix{kind}: end -->"


def render(runs: list[tuple[str, int, dict]], model: str, facts: str, emulated: str) -> str:
    """The section: how it was made, then one row per engine row, a column of three per workload."""
    names = list(dict.fromkeys(r["engine"] for _, _, result in runs for r in result["results"]))
    head = "| engine | " + " | ".join(f"{w}, {n} at once: tok/s, x float32, x best peer" for w, n, _ in runs) + " |"
    begin, end = markers(emulated)
    lines = [
        begin,
        "### Benchmark matrix (`pagedllm bench --matrix`" + (", emulated)" if emulated else ")"),
        "",
        f"{time.strftime('%Y-%m-%d')}, model {model}; {facts}; L3 {l3_size()}; "
        + (f"**emulated** ({emulated})" if emulated else "native (nothing emulated)")
        + ". Output tok/s, one engine at a time; ratios within the same run.",
        "",
        head,
        "|---|" + "---:|" * len(runs),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_cell(name, result["results"]) for _, _, result in runs) + " |")
    lines.append(end)
    return "\n".join(lines)


def _cell(name: str, rows: list[dict]) -> str:
    """Row ``name``'s figures in one workload's ``rows``: tok/s, over pagedllm's float32 dense
    row, and (pagedllm's rows) over the fastest peer row; empty where the workload has no such row."""
    row = next((r for r in rows if r["engine"] == name), None)
    if row is None or "skipped" in row:
        return "skipped" if row is not None else ""
    rate = row["output_tokens_per_s"]
    base = next((r for r in rows if r["engine"] == "pagedllm float32 none" and "skipped" not in r), None)
    peers = [r["output_tokens_per_s"] for r in rows if not r["engine"].startswith("pagedllm") and "skipped" not in r]
    versus_float = f"{rate / base['output_tokens_per_s']:.2f}x" if base else "-"
    versus_peer = f"{rate / max(peers):.2f}x" if peers and name.startswith("pagedllm") else "-"
    return f"{rate:.1f}, {versus_float}, {versus_peer}"


def write_section(path: Path, section: str, emulated: str) -> None:
    """The section into ``path``: in place of the one between its markers, else at its end."""
    text = path.read_text() if path.exists() else ""
    begin, end = markers(emulated)
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        text = before + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    path.write_text(text)


def main(args) -> int:
    peers = installed_peers(args)
    runs, code = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for workload, prompts in workloads(args):
            sub = copy.copy(args)
            sub.matrix, sub.workload, sub.num_prompts = False, workload, prompts
            sub.variants = args.variants or ",".join(MATRIX_VARIANTS)
            sub.compare, sub.json = ",".join(peers), str(Path(tmp) / f"{workload}.json")
            code = max(code, run.main(sub))
            if Path(sub.json).exists():
                runs.append((workload, prompts, json.loads(Path(sub.json).read_text())))
    if not runs:
        return code or 1
    emulated = emulation()
    section = render(runs, runs[0][2]["model"], machine(), emulated)
    print(section)
    if args.matrix_doc:
        write_section(Path(args.matrix_doc), section, emulated)
    return code
