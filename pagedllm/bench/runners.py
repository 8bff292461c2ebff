"""One engine, one workload, in this process; prints a JSON result on stdout.

    python -m pagedllm.bench.runners ENGINE WORKLOAD.json MODEL_DIR DTYPE [OPTIONS.json]

ENGINE: pagedllm, hf-static, hf-cb (vLLM and llama.cpp run from their own venvs: vllm_runner.py,
llama_cpp_runner.py). Timings cover generation only (model loading and a
short warm-up are excluded); peak RSS is the whole process's, loading included.
"""

from __future__ import annotations

import hashlib
import json
import resource
import statistics
import sys
import time

from .bench_result import print_result, throughput


def _rss_peak_bytes() -> int:
    """The larger of this process's peak and its largest child's: children here (a GGUF
    conversion, a kernel build) finish before the engine starts, so they never add to it."""
    self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(self, children) * 1024


def _result(
    engine: str,
    workload: dict,
    elapsed: float,
    output_tokens: int,
    ttft: list[float] | None = None,
    itl: list[float] | None = None,
    **extra,
) -> dict:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    out = {**throughput(engine, workload["prompts"], elapsed, output_tokens, _rss_peak_bytes()), **extra}
    if ttft:
        out.update(ttft_p50_s=statistics.median(ttft), ttft_p99_s=pct(ttft, 0.99))
    if itl:
        out.update(itl_p50_s=statistics.median(itl), itl_p99_s=pct(itl, 0.99))
    return out


def run_pagedllm(workload: dict, model_dir: str, dtype: str, options: dict) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.memory.machine import resident_bytes

    interpreter = resident_bytes()[0]  # torch and pagedllm imported, nothing loaded
    llm = LLM(model_dir, dtype=dtype, **options)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in workload["max_tokens"]]
    llm.generate(workload["prompts"][:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    steps_before = llm.stats.steps
    counters = llm.engine.scheduler.counters
    drafted, accepted, guessed_rows = counters.tokens_drafted, counters.tokens_accepted, counters.speculative_rows
    start = time.perf_counter()
    if workload.get("one_at_a_time"):
        outs = [llm.generate([p], [s])[0] for p, s in zip(workload["prompts"], params)]
    else:
        outs = llm.generate(workload["prompts"], params)
    elapsed = time.perf_counter() - start
    steps = llm.stats.steps - steps_before
    speculative = {}
    if options.get("speculative_method"):
        rows = counters.speculative_rows - guessed_rows
        speculative = dict(
            tokens_drafted=counters.tokens_drafted - drafted,
            tokens_accepted=counters.tokens_accepted - accepted,
            speculative_rows=rows,
        )
    outputs_digest = hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:16]
    ttft = [o.metrics.time_to_first_token for o in outs]
    itl = [
        (o.metrics.latency - o.metrics.time_to_first_token) / (len(o.token_ids) - 1)
        for o in outs
        if len(o.token_ids) > 1
    ]
    plan = llm.memory_plan
    ranks = getattr(llm.engine, "ranks", None)
    split = {}
    if ranks is not None:  # each rank's peak above what it held before loading its shard
        split = dict(tensor_parallel_size=ranks.group.size, rank_memory=ranks.memory())
        llm.close()
    return _result(
        "pagedllm",
        workload,
        elapsed,
        sum(len(o.token_ids) for o in outs),
        ttft,
        itl,
        num_blocks=plan.num_blocks,
        max_batch_tokens=plan.max_batch_tokens,
        max_num_seqs=plan.max_num_seqs,
        memory_budget_bytes=plan.budget_bytes,
        interpreter_rss_bytes=interpreter,
        weights_bytes=plan.weights_bytes,
        step_read_bytes=plan.weights_bytes - _untied_embedding_bytes(llm.engine.loaded.model),
        steps=steps,
        outputs_digest=outputs_digest,
        **speculative,
        **split,
    )


def _untied_embedding_bytes(model) -> int:
    """An untied embedding table's bytes: a step reads one row of it per token, not the table, so
    the weights a step reads are the others (a tied table is the head too, read whole each step;
    4.9% of a 1.9B Llama's Q4_K_M bytes, which the read share had counted as read)."""
    if model.config.tie_word_embeddings:
        return 0
    table = model.model.embed_tokens
    held = [t.numel() * t.element_size() for t in [*table.parameters(), *table.buffers()]]
    # a table kept quantized (QuantizedEmbedding) holds its weight outside parameters and buffers
    return sum(held) + sum(w.nbytes() for w in getattr(table, "quantized_weights", list)())


def run_hf_static(workload: dict, model_dir: str, dtype: str, options: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    batch = int(options.get("batch_size", 32))
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            new = max(max_tokens[i : i + batch])
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
            produced += (out.shape[1] - width) * len(chunk)
    return _result(f"hf-static (batch {batch})", workload, time.perf_counter() - start, produced)


def run_hf_cb(workload: dict, model_dir: str, dtype: str, options: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    config = GenerationConfig(
        max_new_tokens=max(workload["max_tokens"]), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    outs = model.generate_batch(inputs=workload["prompts"], generation_config=config)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outs.values())
    return _result("hf-cb (generate_batch)", workload, elapsed, produced)


RUNNERS = {"pagedllm": run_pagedllm, "hf-static": run_hf_static, "hf-cb": run_hf_cb}


def main(argv: list[str]) -> int:
    engine, workload_path, model_dir, dtype = argv[:4]
    options = json.loads(open(argv[4]).read()) if len(argv) > 4 else {}
    workload = json.loads(open(workload_path).read())
    try:
        result = RUNNERS[engine](workload, model_dir, dtype, options)
    except ImportError as e:
        result = {"engine": engine, "skipped": f"not installed ({e})"}
    print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
