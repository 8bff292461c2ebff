"""The vLLM peer of `pagedllm bench --compare vllm`, run with vLLM's own Python (it pins its own
torch): python pagedllm/bench/vllm_runner.py WORKLOAD.json MODEL_DIR DTYPE. Prints BENCH_RESULT json.

vLLM's CPU backend is set up as its docs recommend for this machine:
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 (set by pagedllm bench).
"""

import json
import resource
import sys
import time

from bench_result import print_result, throughput


def main() -> None:
    workload_path, model_dir, dtype = sys.argv[1:4]
    workload = json.loads(open(workload_path).read())
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=4096, enforce_eager=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in workload["max_tokens"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    rss = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    ) * 1024  # vLLM's engine core is a child process running beside this one: the sum
    print_result(throughput("vllm-cpu", workload["prompts"], elapsed, produced, rss))


if __name__ == "__main__":
    main()
