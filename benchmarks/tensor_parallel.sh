#!/usr/bin/env bash
# Tensor parallelism's targets on this host, in one run: a model that splits over 2 ranks (a random
# Llama with Qwen2.5-0.5B's shapes: the default model's 9 heads split only over 3), the 64-prompt
# workload and one request alone, fp32 and bf16, at tp=1 (every core) and tp=2 (the cores split
# between the ranks); then the all-reduce micro-benchmark. One engine at a time.
#   benchmarks/tensor_parallel.sh [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-/tmp/pagedllm-qwen2.5-0.5b-random}"
[ -f "$model/config.json" ] || .venv/bin/python benchmarks/random_llama.py "$model" --config qwen2.5-0.5b
grep -o 'avx512_bf16\|avx512_vnni\|amx_[a-z0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for workload in standard single; do
    .venv/bin/pagedllm bench --model "$model" --workload "$workload" --tensor-parallel-sizes 1,2 \
        --variants float32:stored,bfloat16:stored --json "docs/tensor_parallel_${workload}.json"
done
.venv/bin/pagedllm bench --allreduce -tp 2
