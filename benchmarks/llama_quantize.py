"""Quantizes a GGUF with llama.cpp's own quantizer (``llama_model_quantize``, as its
``llama-quantize`` tool does), from the llama-cpp-python package: the Q4_K_M and Q2_K files of
issue 65 are made so, never by pagedllm. Run it with the interpreter that has llama-cpp-python
(a venv of its own, never pagedllm's dependency):

    PEER/bin/python benchmarks/llama_quantize.py IN.f16.gguf OUT.Q4_K_M.gguf Q4_K_M
"""

from __future__ import annotations

import sys

import llama_cpp

# llama.h's llama_ftype numbers of the files people download
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def main() -> int:
    source, target, kind = sys.argv[1:4]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if status != 0:
        print(f"llama_model_quantize failed: {status}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
