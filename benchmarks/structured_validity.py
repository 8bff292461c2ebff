"""How many outputs parse and validate, with and without a constraint, per dtype.

    PAGEDLLM_CACHE=/tmp/pcache .venv/bin/python benchmarks/structured_validity.py [--dtypes float32,bfloat16]

For each of the eight schemas of ``pagedllm.bench.schemas``: one chat request asking for an
example as JSON, greedy and at temperature 0.8 with five seeds. "Asked" sends the schema in the
prompt and tells the model to reply with JSON only (what a user does without structured output);
"constrained" sends the same request with ``structured_output=StructuredOutput(json=schema)``.
An output counts when ``json.loads`` reads it and ``jsonschema`` validates it.
"""

from __future__ import annotations

import argparse
import json

import jsonschema

from pagedllm import LLM, SamplingParams
from pagedllm.bench.schemas import SCHEMAS
from pagedllm.sampling_params import StructuredOutput


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=400)
    args = ap.parse_args()
    print("| dtype | mode | valid / outputs | per schema (greedy + seeds) |")
    print("|---|---|---:|---|")
    for dtype in args.dtypes.split(","):
        llm = LLM(dtype=dtype)
        samplings = [dict(temperature=0)] + [dict(temperature=0.8, seed=s) for s in range(args.seeds)]
        for mode in ("asked", "constrained"):
            prompts, params, schemas = [], [], []
            for name, schema in SCHEMAS.items():
                text = f"Give me an example of a {name}, as JSON."
                if mode == "asked":
                    text += f" Reply with JSON only, valid against this schema: {json.dumps(schema)}"
                prompt = llm.apply_chat_template([{"role": "user", "content": text}])
                for sampling in samplings:
                    constraint = StructuredOutput(json=schema) if mode == "constrained" else None
                    prompts.append(prompt)
                    params.append(SamplingParams(max_tokens=args.max_tokens, structured_output=constraint, **sampling))
                    schemas.append(schema)
            outs = llm.generate(prompts, params)
            ok = [valid(o.text, s) for o, s in zip(outs, schemas)]
            per = len(samplings)
            by_schema = ", ".join(f"{n} {sum(ok[i * per : (i + 1) * per])}" for i, n in enumerate(SCHEMAS))
            print(f"| {dtype} | {mode} | {sum(ok)} / {len(ok)} | {by_schema} |", flush=True)


if __name__ == "__main__":
    main()
