"""The llama.cpp peer of `pagedllm bench --compare llama.cpp`: every request decoded in parallel
(one llama.cpp sequence each, batched through its low-level batch API), greedy, ignore_eos.
Run with the Python of a venv that has llama-cpp-python; needs nothing from pagedllm:

    python pagedllm/bench/llama_cpp_runner.py WORKLOAD.json MODEL.gguf THREADS [PROMPT_LOOKUP.json]

Prints BENCH_RESULT json. Prompts are fed in chunks of up to 512 tokens (several sequences per
chunk), then each step decodes one token of every unfinished sequence. A workload of requests
one at a time runs through the high-level ``Llama`` API instead, one completion after another,
with PROMPT_LOOKUP ({"num_pred_tokens": K, "max_ngram_size": N}) as its
``LlamaPromptLookupDecoding`` draft model when given (llama.cpp's own n-gram speculation).
"""

import ctypes
import json
import resource
import sys
import time

import numpy as np
from bench_result import print_result, throughput

CHUNK = 512


def _parallel_context(L, gguf: str, sequences: int, tokens: int, threads: int):
    """(a llama.cpp context for ``sequences`` sequences of ``tokens`` in all, the vocabulary's size)."""
    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = tokens
    cp.n_batch = cp.n_ubatch = CHUNK
    cp.n_seq_max = sequences
    cp.n_threads = cp.n_threads_batch = threads
    return L.llama_init_from_model(model, cp), L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))


def main() -> None:
    workload_path, gguf, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    workload = json.loads(open(workload_path).read())
    try:
        import llama_cpp as L
    except ImportError as e:
        print_result({"engine": "llama.cpp", "skipped": f"not installed ({e})"})
        return

    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    if workload.get("one_at_a_time"):
        lookup = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
        one_at_a_time(L, gguf, threads, prompts, max_tokens, lookup)
        return
    n = len(prompts)
    per_seq = max(len(p) + m for p, m in zip(prompts, max_tokens)) + 1
    ctx, n_vocab = _parallel_context(L, gguf, n, per_seq * n, threads)
    batch = L.llama_batch_init(CHUNK, 0, 1)

    def decode(entries):  # entries: (seq, pos, token, wants_logits); returns rows' argmax per seq
        out = {}
        for c0 in range(0, len(entries), CHUNK):
            chunk = entries[c0 : c0 + CHUNK]
            for i, (s, pos, tok, want) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = s, want
            batch.n_tokens = len(chunk)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (s, _, _, want) in enumerate(chunk):
                if want:
                    ptr = L.llama_get_logits_ith(ctx, i)
                    row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
                    out[s] = int(row.argmax())
        return out

    def run(prompts, max_tokens):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        entries = [(s, pos, t, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        last = decode(entries)
        produced = {s: 1 for s in last}
        while True:
            live = [s for s in last if produced[s] < max_tokens[s]]
            if not live:
                return sum(produced.values())
            last.update(decode([(s, len(prompts[s]) + produced[s] - 1, last[s], True) for s in live]))
            for s in live:
                produced[s] += 1

    run(prompts[:2], [2, 2])  # warm-up
    start = time.perf_counter()
    produced = run(prompts, max_tokens)
    elapsed = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = f"llama.cpp ({n} parallel)" if n > 1 else "llama.cpp"
    print_result(throughput(engine, prompts, elapsed, produced, rss))


def one_at_a_time(L, gguf, threads, prompts, max_tokens, lookup) -> None:
    """Each prompt alone, greedy, its end-of-text token forbidden (ignore_eos)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(**lookup) if lookup else None
    n_ctx = max(len(p) + m for p, m in zip(prompts, max_tokens)) + 8
    llm = L.Llama(
        model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
    )
    no_eos = {llm.token_eos(): float("-inf")}

    def complete(prompt, m):
        out = llm.create_completion(prompt, max_tokens=m, temperature=0.0, logit_bias=no_eos)
        return out["usage"]["completion_tokens"]

    complete(prompts[0], 2)  # warm-up
    start = time.perf_counter()
    produced = sum(complete(p, m) for p, m in zip(prompts, max_tokens))
    elapsed = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = "llama.cpp prompt lookup" if lookup else "llama.cpp"
    print_result(throughput(engine, prompts, elapsed, produced, rss))


if __name__ == "__main__":
    main()
