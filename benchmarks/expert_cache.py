"""A model under a budget smaller than its weights (issue 51): one request's tok/s, its tokens and
the process's peak RSS, with every weight resident (no budget) and at each budget given, every
run in a fresh process; a mixture of experts keeps some experts resident (the expert cache), a
dense model some layers (the others streamed every step); and the same with the file's pages dropped from the page
cache first (``--cold``: posix_fadvise DONTNEED on the converted checkpoint's files).

    python benchmarks/expert_cache.py --model /tmp/moe-a3b/qwen3-moe-a3b-small.Q8_0.gguf \\
        --budgets 1.5GiB,1.25GiB,1GiB,0.85GiB --svg docs/expert-cache.svg

The model is benchmarks/moe_qwen3_a3b.py's (Qwen3-30B-A3B's proportions, 1.46 GB as Q8_0).
Its random weights make greedy decoding repeat one token (and so one set of experts), so the
request samples, seeded: the same tokens in every run. Prints a table (markdown), each layer's
share of the routing its most chosen 20% of experts took (a real router's skew is about 80%),
and writes an SVG plot of tok/s and peak RSS against the budget where ``--svg`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = (
    "The history of the city of Paris begins with a settlement on an island in the Seine. def fibonacci(n): "
    "return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2). Ingredients: two cups of flour, a teaspoon "
    "of salt. Dear committee, I am writing to apply for the position of"
)


def drop_from_page_cache(model: str) -> None:
    """posix_fadvise(DONTNEED) over the GGUF file and its converted checkpoint."""
    from pagedllm.loading import resolve_model_dir
    from pagedllm.loading.checkpoint import safetensors_files

    for f in [Path(model), *safetensors_files(resolve_model_dir(model)[0])]:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_one(model: str, memory: str | None, max_tokens: int, dtype: str, cold: bool) -> dict:
    """In this (fresh) process: load, warm up, drop the file's pages if asked, time one request."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **({"memory": memory} if memory else {}))
    llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    if cold:
        drop_from_page_cache(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, ignore_eos=True)
    cache, stream = llm.loaded.model.expert_cache, llm.loaded.model.layer_stream
    streamed_before = stream.stats.bytes_read if stream else 0
    before = (
        (
            cache.stats.hits,
            cache.stats.misses,
            cache.stats.bytes_read,
            cache.stats.prefetched,
            cache.stats.prefetch_unused,
        )
        if cache
        else (0,) * 5
    )
    start = time.perf_counter()
    out = llm.generate([PROMPT], params)[0]
    seconds = time.perf_counter() - start
    peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
    result = {
        "memory": memory or "none",
        "tok_s": max_tokens / seconds,
        "tokens": out.token_ids,
        "peak_rss": peak,
        "slots": sum(p.slots for p in cache.pools) if cache else None,
    }
    if stream is not None:
        result.update(streamed=len(stream.order), bytes_read=stream.stats.bytes_read - streamed_before)
    if cache is not None:
        stats = cache.stats
        result.update(
            hits=stats.hits - before[0],
            misses=stats.misses - before[1],
            bytes_read=stats.bytes_read - before[2],
            ahead=stats.prefetched - before[3],
            ahead_unused=stats.prefetch_unused - before[4],
        )
        shares = []
        for _, counts in sorted(cache.frequency.items()):
            ranked = counts.float().sort(descending=True).values
            shares.append(round(float(ranked[: len(ranked) // 5].sum() / ranked.sum()), 2))
        result["top20_share"] = shares
    return result


LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
model, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = Llama(model_path=model, n_ctx=1024, n_threads=2, n_batch=512, verbose=False)
eos = llm.token_eos()
llm(prompt, max_tokens=4, temperature=0.0)
start = time.perf_counter()
out = llm(prompt, max_tokens=max_tokens, temperature=1.0, seed=1, logit_bias={eos: -100.0})
seconds = time.perf_counter() - start
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
n = out["usage"]["completion_tokens"]
print(json.dumps({"memory": "llama.cpp", "tok_s": n / seconds, "tokens": [], "peak_rss": peak, "slots": None}))
"""


def child(model: str, memory: str | None, max_tokens: int, dtype: str, cold: bool, cgroup: Path | None) -> dict:
    argv = [sys.executable, __file__, "--child", "--model", model, "--max-tokens", str(max_tokens), "--dtype", dtype]
    argv += ["--budgets", memory or "none"] + (["--cold"] if cold else [])
    return _run(argv, memory or "none", cgroup)


def llama_cpp(python: str, model: str, max_tokens: int, cgroup: Path | None) -> dict:
    return _run([python, "-c", LLAMA_CPP, model, PROMPT, str(max_tokens)], "llama.cpp", cgroup)


def _run(argv: list[str], name: str, cgroup: Path | None) -> dict:
    """A child process, inside ``cgroup`` (a folder of a cgroup v1 or v2 hierarchy whose memory
    limit the caller set) when given. The model's files leave the page cache first: a page
    cached already stays charged to whoever read it, outside the child's limit."""
    if cgroup is not None:
        drop_from_page_cache(argv[argv.index("--model") + 1] if "--model" in argv else argv[3])

    def enter() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    done = subprocess.run(argv, capture_output=True, text=True, preexec_fn=enter)
    if done.returncode != 0:
        return {"memory": name, "error": f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def svg(rows: list[dict], path: Path) -> None:
    """tok/s (left axis) and peak RSS (right) against the budget, no plotting library needed."""
    points = [r for r in rows if "error" not in r and r["memory"] not in ("none", "llama.cpp")]
    if not points:
        return
    gib = [_gib(r["memory"]) for r in points]
    lo, hi = min(gib), max(gib)
    top_rate = max(r["tok_s"] for r in rows if "error" not in r) * 1.1
    top_rss = max(max(r["peak_rss"] for r in points) / 2**30, hi) * 1.1
    w, h, pad = 560, 320, 50

    def x(v: float) -> float:
        return pad + (v - lo) / max(hi - lo, 1e-9) * (w - 2 * pad)

    def y(v: float, top: float) -> float:
        return h - pad - v / top * (h - 2 * pad)

    rate = " ".join(f"{x(g):.1f},{y(r['tok_s'], top_rate):.1f}" for g, r in zip(gib, points))
    rss = " ".join(f"{x(g):.1f},{y(r['peak_rss'] / 2**30, top_rss):.1f}" for g, r in zip(gib, points))
    bound = f"{x(lo):.1f},{y(lo, top_rss):.1f} {x(hi):.1f},{y(hi, top_rss):.1f}"
    full = next((r["tok_s"] for r in rows if r["memory"] == "none" and "error" not in r), None)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
        f'<polyline points="{rate}" fill="none" stroke="#1f77b4" stroke-width="2"/>',
        f'<polyline points="{rss}" fill="none" stroke="#d62728" stroke-width="2"/>',
        f'<polyline points="{bound}" fill="none" stroke="#d62728" stroke-dasharray="4 3"/>',
        f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">budget (GiB): {lo:.2f} .. {hi:.2f}</text>',
        f'<text x="{pad}" y="16" fill="#1f77b4">tok/s (one request; every expert resident: '
        f"{full and round(full, 1)})</text>",
        f'<text x="{pad}" y="30" fill="#d62728">peak RSS (GiB); dashed: the budget</text>',
    ]
    for g, r in zip(gib, points):
        parts.append(
            f'<text x="{x(g):.1f}" y="{y(r["tok_s"], top_rate) - 6:.1f}" text-anchor="middle">{r["tok_s"]:.1f}</text>'
        )
        rss_gib = r["peak_rss"] / 2**30
        parts.append(
            f'<text x="{x(g):.1f}" y="{y(rss_gib, top_rss) + 14:.1f}" text-anchor="middle">{rss_gib:.2f}</text>'
        )
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def _gib(memory: str) -> float:
    from pagedllm.sizes import parse_memory

    return parse_memory(memory) / 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", default="1GiB", help="comma-separated memory= values; 'none': no budget")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cold", action="store_true", help="drop the file's pages from the page cache before timing")
    ap.add_argument("--svg", type=Path)
    ap.add_argument("--cgroup", type=Path, help="run every budgeted child (and llama.cpp) inside this cgroup")
    ap.add_argument("--llama-python", help="also run llama.cpp (llama-cpp-python in this interpreter) on the file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        memory = None if a.budgets == "none" else a.budgets
        print(json.dumps(run_one(a.model, memory, a.max_tokens, a.dtype, a.cold)))
        return 0
    budgets = [None if b == "none" else b for b in a.budgets.split(",")]
    rows = [child(a.model, None, a.max_tokens, a.dtype, False, None)]
    rows += [child(a.model, b, a.max_tokens, a.dtype, a.cold, a.cgroup) for b in budgets if b is not None]
    if a.llama_python:
        rows.append(llama_cpp(a.llama_python, a.model, a.max_tokens, a.cgroup))
    full = rows[0]
    print(
        f"# {a.model}, {a.dtype}, one request of {a.max_tokens} tokens (seeded sampling); cold: {a.cold}; "
        f"cgroup: {a.cgroup}"
    )
    print(
        "| memory= | tok/s | of unbounded | tokens | peak RSS | resident experts (or layers streamed) "
        "| hits / misses | read a token | read ahead (unused) |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['memory']} | {r['error']} |")
            continue
        same = (
            "identical"
            if r["tokens"] == full.get("tokens")
            else ("(its own)" if r["memory"] == "llama.cpp" else "DIFFER")
        )
        misses = f"{r['hits']} / {r['misses']}" if r.get("slots") else ""
        read = f"{r['bytes_read'] / a.max_tokens / 2**20:.0f} MiB" if "bytes_read" in r else ""
        resident = r.get("slots") or (f"{r['streamed']} streamed" if r.get("streamed") else "all")
        print(
            f"| {r['memory']} | {r['tok_s']:.1f} | {r['tok_s'] / full['tok_s']:.2f}x | {same} | "
            f"{r['peak_rss'] / 2**30:.3f} GiB | {resident} | {misses} | {read} | "
            + (f"{r['ahead']} ({r['ahead_unused']}) |" if r.get("slots") else " |")
        )
    for r in rows:
        if r.get("top20_share"):
            print(f"# memory={r['memory']}: the most chosen 20% of experts' share, per layer: {r['top20_share']}")
    if a.svg:
        svg(rows, a.svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
