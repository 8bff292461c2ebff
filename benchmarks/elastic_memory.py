"""Elastic memory, measured: the budget changed while the default model serves the benchmark's
standard workload (64 prompts of 16-256 tokens, 64 new tokens each, greedy, float32 activations
over the weights as stored), resident memory (VmRSS) sampled every 50 ms. Issue 29's targets:

1. shrink to half under load (2 GiB -> 1 GiB, then back): RSS under the new budget within 2 s,
   no request lost, no output changed against a run that was never resized;
2. idle release (``pagedllm serve --idle-release-after``): the idle server's RSS at most the
   interpreter + the weights + 10% of the cache (the interpreter and weights as the server measured
   them at start: the plan's baseline and weights);
3. throughput with a resize every 5 s (1 GiB / 640 MiB alternating) >= 0.8x a fixed 640 MiB run.

Every run is a fresh process (its RSS is its own), one at a time. ``max_model_len=1024`` for all
of them: at the model's own 8192 the smallest cache (one full-length request) needs 0.92 GiB, so
no budget of 640 MiB could hold it. Needs matplotlib for the plot (``pip install -e .[bench]``).

    .venv/bin/python benchmarks/elastic_memory.py --plot docs/elastic_memory.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 2**20
MAX_MODEL_LEN = 1024


def rss(pid: int | str = "self") -> int:
    from pagedllm.memory.machine import resident_bytes

    return resident_bytes(pid)[0]


class Sampler:
    """RSS (of ``pids()``), the budget and the plan's total, every 50 ms on a thread of its own."""

    def __init__(self, pids, plan):
        self.pids, self.plan, self.samples = pids, plan, []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            budget, total = self.plan()
            resident = sum(rss(p) for p in self.pids())
            self.samples.append((time.monotonic() - self.t0, resident, budget, total))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


# ---- the runs, each in a process of its own ------------------------------------------------------


def run_offline(memory: str, resizes: list[tuple[float, str]], every: float | None = None) -> dict:
    """The workload through one engine under ``memory``; ``resizes``: (seconds, budget) to move to;
    ``every``: then keep alternating those budgets every so many seconds until the work is done."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench import workloads

    llm = LLM(memory=memory, dtype="float32", max_model_len=MAX_MODEL_LEN)
    engine = llm.engine
    work = workloads.standard(llm.tokenizer, 64, 64)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    sampler = Sampler(lambda: ["self"], lambda: (engine.memory_plan.budget_bytes, engine.memory_plan.total_bytes))
    start = sampler.now()
    ids = [engine.add_request(p, params) for p in work.prompts]
    outputs, moves, pending = {}, [], list(resizes)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if pending and sampler.now() - start >= pending[0][0]:
            at, budget = pending.pop(0)
            t = sampler.now()
            plan = llm.set_memory(budget)
            moves.append({"at": t, "took": sampler.now() - t, "budget": plan.budget_bytes, "blocks": plan.num_blocks})
            if every is not None:
                pending.append((at + every * len(resizes), budget))
    elapsed = sampler.now() - start
    time.sleep(0.5)  # a few samples after the end
    return {
        "memory": memory,
        "elapsed": elapsed,
        "tokens": sum(len(t) for t in outputs.values()),
        "outputs": [outputs.get(i) for i in ids],
        "preemptions": engine.stats.preemptions,
        "computed": engine.stats.tokens_computed,  # prompts, outputs and what preemptions recomputed
        "steps": engine.stats.steps,
        "moves": moves,
        "samples": sampler.stop(),
        "plan": llm.memory_plan.to_dict(),
    }


def run_idle_server(memory: str, idle_after: float) -> dict:
    """``pagedllm serve`` under ``memory`` with idle release: the workload over HTTP (8 at a
    time), then idle until the release, then one request (it pays the page faults)."""
    from pagedllm.bench import workloads
    from pagedllm.loading import load_tokenizer, resolve_model_dir

    port_file = Path(tempfile.mkdtemp()) / "port"
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--port", "0", "--port-file", str(port_file)]
    command += ["--memory", memory, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    server = subprocess.Popen([*command, "--idle-release-after", str(idle_after)])
    try:
        while not port_file.exists() or not port_file.read_text().endswith("\n"):
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        _wait_healthy(url)
        tokenizer = load_tokenizer(resolve_model_dir(None)[0])
        work = workloads.standard(tokenizer, 64, 64)
        plan = _get(url + "/v1/memory")
        pids = [server.pid, *_children(server.pid)]
        sampler = Sampler(lambda: pids, lambda: (plan["budget_bytes"], plan["total_bytes"]))
        ready = sum(rss(p) for p in pids)  # (an idle start is released too, after idle_after)
        releases = _metric(url, "pagedllm_idle_releases_total")
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: _complete(url, p), work.prompts))
        busy_end = sampler.now()
        busy = sum(rss(p) for p in pids)
        while _metric(url, "pagedllm_idle_releases_total") <= releases and sampler.now() - busy_end < idle_after + 30:
            time.sleep(0.2)
        released_at = sampler.now()
        time.sleep(1)
        idle = sum(rss(p) for p in pids)
        prompt = max(work.prompts, key=len)
        t = time.monotonic()
        _complete(url, prompt)
        first_after = time.monotonic() - t
        t = time.monotonic()
        _complete(url, [prompt[1], *prompt[1:]])  # as long, nothing of it cached, its pages resident now
        second = time.monotonic() - t
        return {
            "plan": plan,
            "ready": ready,
            "busy": busy,
            "idle": idle,
            "released_after_s": released_at - busy_end,
            "first_request_after_s": first_after,
            "same_request_again_s": second,
            "samples": sampler.stop(),
        }
    finally:
        server.terminate()
        server.wait(60)


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _wait_healthy(url: str) -> None:
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=30).read())


def _complete(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def _metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url + "/metrics", timeout=30).read().decode().splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


PHASES = {
    "fixed-2GiB": lambda: run_offline("2GiB", []),
    "shrink": lambda: run_offline("2GiB", [(6.0, "1GiB"), (16.0, "2GiB")]),
    "fixed-640MiB": lambda: run_offline("640MiB", []),
    "alternating": lambda: run_offline("1GiB", [(5.0, "640MiB"), (10.0, "1GiB")], every=5.0),
    # the same without the settling time (engine/elastic.py, GROW_SETTLE_S): every grow admits at once
    "alternating-unsettled": lambda: run_offline("1GiB", [(5.0, "640MiB"), (10.0, "1GiB")], every=5.0),
    "idle-server": lambda: run_idle_server("1GiB", 2.0),
}


def in_own_process(phase: str) -> dict:
    env = {**os.environ, **({"PAGEDLLM_GROW_SETTLE_S": "0"} if phase.endswith("-unsettled") else {})}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--phase", phase, "--out", out.name], check=True, env=env)
        return json.loads(Path(out.name).read_text())


# ---- the report ------------------------------------------------------------------------------------


def shrink_report(run: dict, reference: dict) -> list[str]:
    lines = []
    for move in run["moves"]:
        under = next((t for t, r, _, _ in run["samples"] if t >= move["at"] and r <= move["budget"]), None)
        within = "never" if under is None else f"{under - move['at']:.2f} s"
        lines.append(
            f"  at {move['at']:5.1f} s: set_memory({move['budget'] / MiB:.0f} MiB) took {move['took'] * 1e3:.0f} ms, "
            f"{move['blocks']} blocks; RSS under the new budget after {within}"
        )
    lost = sum(o is None for o in run["outputs"])
    changed = sum(a != b for a, b in zip(run["outputs"], reference["outputs"]))
    peak = max(r for _, r, _, _ in run["samples"])
    lines.append(f"  requests lost: {lost}; outputs changed against the never-resized run: {changed} of 64")
    lines.append(f"  peak RSS {peak / MiB:.0f} MiB; preemptions {run['preemptions']}")
    return lines


def idle_report(run: dict) -> list[str]:
    plan = run["plan"]
    bound = plan["baseline_bytes"] + plan["weights_bytes"] + 0.1 * plan["kv_cache_bytes"]
    return [
        f"  RSS idle at start {run['ready'] / MiB:.0f} MiB, after the workload {run['busy'] / MiB:.0f} MiB, "
        f"idle after the release {run['idle'] / MiB:.0f} MiB (released {run['released_after_s']:.1f} s after the last)",
        f"  target: <= baseline {plan['baseline_bytes'] / MiB:.0f} + weights {plan['weights_bytes'] / MiB:.0f} "
        f"+ 10% of the cache {plan['kv_cache_bytes'] / MiB:.0f} = {bound / MiB:.0f} MiB: "
        f"{'met' if run['idle'] <= bound else 'NOT met'}",
        f"  one request (256 prompt tokens, 64 new) right after the release {run['first_request_after_s']:.2f} s, "
        f"one as long with its pages resident {run['same_request_again_s']:.2f} s",
    ]


def rate(run: dict) -> float:
    return run["tokens"] / run["elapsed"]


def plot(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, resident, budget, total = zip(*run["samples"])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, [b / MiB for b in budget], "--", label="budget (memory=)")
    ax.plot(t, [p / MiB for p in total], ":", label="the plan's peak")
    ax.plot(t, [r / MiB for r in resident], "-", label="VmRSS (every 50 ms)")
    for move in run["moves"]:
        ax.axvline(move["at"], color="grey", alpha=0.3)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title("64 requests under load; set_memory 2 GiB -> 1 GiB -> 2 GiB (default model, float32)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=sorted(PHASES), help="one run, in this process (the driver's)")
    ap.add_argument("--out", help="--phase: where its JSON goes")
    ap.add_argument("--plot", type=Path, help="the shrink run's RSS, budget and plan over time, as a PNG")
    ap.add_argument("--json", type=Path, help="every run's figures")
    ap.add_argument("--throughput-only", action="store_true", help="only the throughput rounds (target 3)")
    ap.add_argument("--rounds", type=int, default=3, help="throughput: fixed / alternating pairs (the box drifts)")
    args = ap.parse_args()
    if args.phase:
        Path(args.out).write_text(json.dumps(PHASES[args.phase]()))
        return 0
    flags = sorted(f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx512_bf16", "amx", "avx2")))
    print(f"CPU flags: {' '.join(sorted(set(flags)))}; {os.cpu_count()} CPUs")
    memory_parts = () if args.throughput_only else ("fixed-2GiB", "shrink", "idle-server")
    runs = {phase: in_own_process(phase) for phase in memory_parts}
    rounds = [
        [in_own_process(p) for p in ("fixed-640MiB", "alternating", "alternating-unsettled")]
        for _ in range(args.rounds)
    ]
    runs["rounds"] = rounds
    if not args.throughput_only:
        print("1. shrink to half under load (2 GiB -> 1 GiB at 6 s, back to 2 GiB at 16 s):")
        print("\n".join(shrink_report(runs["shrink"], runs["fixed-2GiB"])))
        print("2. idle release (pagedllm serve --memory 1GiB --idle-release-after 2):")
        print("\n".join(idle_report(runs["idle-server"])))
    print(f"3. throughput, 64 prompts, {args.rounds} rounds (each run a fresh process):")
    ratios = []
    for fixed, moving, unsettled in rounds:
        ratios.append(rate(moving) / rate(fixed))
        print(
            f"  fixed 640 MiB {rate(fixed):.1f} tok/s ({fixed['preemptions']} preemptions); "
            f"1 GiB / 640 MiB every 5 s ({len(moving['moves'])} resizes) {rate(moving):.1f} tok/s "
            f"({moving['preemptions']} preemptions): {ratios[-1]:.2f}x; without the settling time "
            f"{rate(unsettled):.1f} tok/s ({unsettled['preemptions']} preemptions): "
            f"{rate(unsettled) / rate(fixed):.2f}x"
        )
    low, median = min(ratios), sorted(ratios)[len(ratios) // 2]
    verdict = "met" if low >= 0.8 else "NOT met"
    print(f"  lowest {low:.2f}x, median {median:.2f}x (target >= 0.8x, every round: {verdict})")
    if args.plot and not args.throughput_only:
        plot(runs["shrink"], args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
