"""A hybrid model's prefix reuse (issue 67): two requests that share a ~560-token prefix, blocks of
16 tokens. The second request's time to its first token on an engine that ran the first (its
blocks and a state checkpoint cached), against a cold engine's, and their tokens compared.

    python benchmarks/hybrid_prefix.py [--layers 8] [--hidden 1024] [--dtype bfloat16]

The model is random, Qwen3.5-shaped (three Gated DeltaNet layers to one gated attention layer,
16 key and value heads of 128 in the delta rule, head_dim 256), built with transformers in a
temporary directory: what is measured is how much of the prompt is recomputed, not what the
weights say. Prints one line per run and the ratio; quote the CPU flags and L3 size with it.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def build(directory: str, layers: int, hidden: int) -> None:
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def first_token(llm, prompt: list[int]) -> tuple[float, int, list[int]]:
    """Seconds to the first token of ``prompt`` (a one-token request), the prompt tokens the
    prefix cache served it, and the next 16 greedy tokens (asked after the timing)."""
    from pagedllm import SamplingParams

    before = llm.engine.blocks.prefix_stats.hit_tokens
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    seconds = time.perf_counter() - start
    reused = llm.engine.blocks.prefix_stats.hit_tokens - before
    return seconds, reused, llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shared", type=int, default=560)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from pagedllm import LLM, SamplingParams

    directory = tempfile.mkdtemp(prefix="hybrid-prefix-")
    build(directory, args.layers, args.hidden)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(10, 30000, (args.shared,), generator=g).tolist()
    first = shared + torch.randint(10, 30000, (24,), generator=g).tolist()
    second = shared + torch.randint(10, 30000, (20,), generator=g).tolist()
    options = dict(dtype=args.dtype, block_size=16, max_num_seqs=4)
    for run in range(args.repeats):  # cold / warm interleaved
        cold_s, _, cold_tokens = first_token(LLM(directory, **options), second)
        warm = LLM(directory, **options)
        warm.generate([first], SamplingParams(max_tokens=1))
        warm_s, reused, warm_tokens = first_token(warm, second)
        del warm
        print(
            f"run {run}: cold {cold_s * 1000:.0f} ms, after the first request {warm_s * 1000:.0f} ms "
            f"({reused} prompt tokens reused) -> {cold_s / warm_s:.2f}x; tokens identical: {cold_tokens == warm_tokens}"
        )


if __name__ == "__main__":
    main()
