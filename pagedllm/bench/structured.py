"""The cost of structured output: ``pagedllm bench --workload structured``.

Two constrained runs, each against the same requests unconstrained:
- one schema: N requests under one JSON schema (compiled once, then cached);
- N schemas: N requests under N different schemas, never seen before by the process, so every
  compile is in the timed run.
Greedy, so a run's outputs are the same every time. The unconstrained twin of a run gets each
request's constrained output length as ``max_tokens`` with ``ignore_eos``: both runs compute the
same tokens in the same batches, and the ratio is the constraint's own cost (compiles, masks,
matcher updates). Each pair runs ``repeats`` times, back to back, which of the two goes first
alternating; the table gives the medians (this machine's timings vary by 10% and more from run
to run, so only runs next to each other compare).
"""

from __future__ import annotations

import json
import statistics
import time

from .schemas import SCHEMAS, distinct_schemas


def _prompts(llm, names: list[str]) -> list[list[int]]:
    """One chat prompt per name, each its own (numbered) so no two share a cached prefix whole."""
    return [
        llm.apply_chat_template([{"role": "user", "content": f"Give me an example of a {name} as JSON ({i})."}])
        for i, name in enumerate(names)
    ]


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, outs


def measure(llm, n: int = 64, repeats: int = 5, max_tokens: int = 256) -> list[dict]:
    """One row per constrained run: tokens, median tokens/s constrained and unconstrained, and
    the median of the ratios of the two runs of each pair (run back to back)."""
    from ..sampling_params import SamplingParams, StructuredOutput

    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(n)]
    rows = []
    for label in ("one schema", f"{n} schemas"):
        rates_c, rates_u, ratios = [], [], []
        lengths: list[int] = []
        for r in range(repeats):
            if label == "one schema":
                schemas = [SCHEMAS["order"]] * n  # outputs of ~50 tokens: long enough runs to time
                prompts = _prompts(llm, ["shop order"] * n)
            else:  # new schemas every repeat: their compiles are part of the run
                schemas = distinct_schemas(n, start=1000 * (r + 1))
                prompts = _prompts(llm, names)
            constrained = [
                SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=StructuredOutput(json=s))
                for s in schemas
            ]
            free_first = r % 2 == 1 and lengths  # odd repeats: the twin first (the last repeat's lengths)
            if free_first:
                rate_u = sum(lengths) / _timed(llm, prompts, _free(lengths))[0]
            seconds, outs = _timed(llm, prompts, constrained)
            lengths = [len(o.token_ids) for o in outs]
            rate_c = sum(lengths) / seconds
            if not free_first:
                rate_u = sum(lengths) / _timed(llm, prompts, _free(lengths))[0]
            rates_c.append(rate_c)
            rates_u.append(rate_u)
            ratios.append(rate_c / rate_u)
        rows.append(
            {
                "run": label,
                "requests": n,
                "output_tokens": sum(lengths),
                "constrained_tok_s": statistics.median(rates_c),
                "unconstrained_tok_s": statistics.median(rates_u),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
            }
        )
    return rows


def _free(lengths: list[int]) -> list:
    from ..sampling_params import SamplingParams

    return [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in lengths]


def table(rows: list[dict]) -> str:
    lines = [
        "| run | requests | output tokens | constrained tok/s | unconstrained tok/s "
        "| constrained / unconstrained (median; each pair) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['requests']} | {r['output_tokens']} | {r['constrained_tok_s']:.1f} | "
            f"{r['unconstrained_tok_s']:.1f} | {r['ratio']:.2f}x ({', '.join(f'{x:.2f}' for x in r['ratios'])}) |"
        )
    return "\n".join(lines)


def main(args) -> int:
    from ..llm import LLM
    from .host import machine

    llm = LLM(args.model, dtype=args.dtype, **({"memory": args.memory} if args.memory else {}))
    llm.generate(_prompts(llm, ["warm-up"] * 4), _warmup_params())  # kernels, caches
    n = args.num_prompts
    print(f"# {llm.loaded.name}, structured output cost: {n} requests, greedy, {args.dtype}")
    print(f"# {machine()}", flush=True)
    rows = measure(llm, n, repeats=args.repeats)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": llm.loaded.name, "dtype": args.dtype, "machine": machine(), "rows": rows}, f, indent=2)
    return 0


def _warmup_params():
    from ..sampling_params import SamplingParams, StructuredOutput

    return SamplingParams(max_tokens=16, temperature=0, structured_output=StructuredOutput(json_object=True))
