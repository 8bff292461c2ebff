"""LLM: the Python API. Loads a model, builds an engine, and runs prompts to completion.

from pagedllm import LLM, SamplingParams
llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
print(out[0].text)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

from . import prompts
from .engine import LLMEngine
from .engine.builder import build_engine
from .engine_config import EngineConfig
from .engine_process.client import EngineProcess, LLMEngineOverProcess
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: EngineConfig | None = None,
        engine_process: bool = False,
        **options,
    ):
        """``LLM(model, **options)``: the options are ``EngineConfig``'s fields (or pass ``config``).

        ``memory="6GiB"`` bounds the whole process's peak resident memory (what it holds
        before this call included); ``memory_fraction=0.9`` lets the engine take that fraction of
        what is free now. Whatever of num_blocks / max_batch_tokens / max_model_len is left unset
        is solved for. ``quantization``: None runs a checkpoint's weights as stored (a GGUF's stay
        quantized), 'int8' / 'int4' quantize float weights at load, 'none' dequantizes all;
        ``kv_cache_dtype``: 'int8' or 'fp8' keep the cache in 8 bits. The plan is checked from
        config.json before any weight is loaded: CacheDoesNotFitError if it cannot fit. With a
        budget, the KV cache is committed at once. ``structured_output``: constrained requests are
        served (with xgrammar installed); under a budget xgrammar loads now, so its ~30 MiB count
        in the measured process, otherwise at the first constrained request (it takes ~1.2 s to
        import). False leaves it out and rejects constrained requests. ``backend``: what computes
        (``pagedllm.backends``), chosen once here. ``engine_process=True`` runs the engine in a
        process of its own (as ``pagedllm serve`` does): this process then holds the tokenizer and
        no weights, ``loaded`` is not set, and ``memory`` bounds both processes together.
        """
        if config is None:
            config = EngineConfig.from_options(model, **options)
        elif model is not None or options:
            raise TypeError("give either config or model and options, not both")
        self.config = config
        self.process: EngineProcess | None = None
        if engine_process:
            self.process = EngineProcess(config, max_waiting=1 << 30)
            self.engine: LLMEngine | LLMEngineOverProcess = LLMEngineOverProcess(self.process)
            self.tokenizer, self.memory_plan, self._name = (
                self.process.tokenizer,
                self.process.memory_plan,
                self.process.name,
            )
            return
        engine = build_engine(config)
        self.engine = engine
        self.loaded = engine.loaded
        self.tokenizer = self.loaded.tokenizer
        self.memory_plan = engine.memory_plan
        self._name = self.loaded.name

    @property
    def stats(self):
        return self.engine.stats

    @property
    def name(self) -> str:
        return self._name

    def close(self) -> None:
        """Stops the engine's process (``engine_process=True``), or the other ranks of a split
        model; either also ends with this process."""
        if self.process is not None:
            self.process.stop()
        elif isinstance(self.engine, LLMEngine):
            self.engine.close()

    def set_memory(self, memory: str | int | None = None, *, memory_fraction: float | None = None):
        """A new budget for the running engine, ``memory`` (``"640MiB"``, or bytes) or
        ``memory_fraction`` (of what is free plus what the engine holds now): the cache shrinks in
        place (the newest requests preempted and recomputed later if what runs no longer fits,
        its freed pages given back to the OS) or grows; returns the new ``MemoryPlan``.
        ``CacheDoesNotFitError`` (nothing changed) when even the smallest cache does not fit.
        Not yet for a split model (``tensor_parallel_size`` > 1)."""
        if self.process is not None:
            self.memory_plan = self.process.set_memory_now(memory, memory_fraction)
        else:
            assert isinstance(self.engine, LLMEngine)
            self.memory_plan = self.engine.set_memory(memory, memory_fraction)
        return self.memory_plan

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def async_engine(self, max_waiting: int):
        """This engine stepped on a thread of this process, for a server (``create_app``); or,
        with ``engine_process=True``, the engine's process."""
        if self.process is not None:
            return self.process.async_engine(max_waiting)
        from .engine_process.engine_thread import AsyncEngine

        assert isinstance(self.engine, LLMEngine)
        return AsyncEngine(self.engine, max_waiting=max_waiting)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        A prompt is a string or a list of token ids; one SamplingParams applies to all, or give
        one per prompt. A prompt that can never run raises before anything is queued. With
        ``n`` > 1, each output's ``outputs`` holds all n samples (its own fields are sample 0's).
        """
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list))
        ids = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in prompt_list]
        for p, sp in zip(ids, params):
            # all-or-nothing: check before queueing any. A grammar is compiled as its request is
            # added (one compile each: 64 new schemas checked first, then added, would push the
            # first out of the cache before they are used); one that fails takes the others back.
            self.engine.validate(p, sp, compile_grammar=False)
        request_ids: list[str] = []
        try:
            for p, sp in zip(ids, params):
                request_ids.append(self.engine.add_request(p, sp))
        except BaseException:
            for rid in request_ids:
                self.engine.abort(rid)
            raise
        samples: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in request_ids}
        done: set[str] = set()
        bar = _Progress(len(prompt_list)) if progress else None
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        samples[out.request_id][out.index] = out
                    if out.request_finished:
                        done.add(out.request_id)
                        if bar:
                            bar.update(sum(len(o.token_ids) for o in samples[out.request_id].values()))
        except BaseException:
            for rid in request_ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        finally:
            if bar:
                bar.close()
        outputs = []
        for rid, prompt in zip(request_ids, prompt_list):
            by_index = samples[rid]
            out = by_index[0]
            out.outputs = [by_index[i].completion() for i in sorted(by_index)]
            out.prompt = prompt if isinstance(prompt, str) else None
            outputs.append(out)
        return outputs

    def embed(self, prompts: Prompt | Seq[Prompt], pooling: str = "last") -> list[list[float]]:
        """Each prompt's embedding: its last hidden states (after the final norm) pooled, the
        last token's ("last") or their mean ("mean"), L2-normalised. Batched with everything
        else the engine runs, under the same plan; nothing is generated."""
        outs = self.generate(prompts, SamplingParams(max_tokens=1, pooling=pooling))
        return [out.embedding or [] for out in outs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the chat template is applied."""
        conversations: list = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, progress)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas as they become final; never splits a multi-byte character."""
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError("stream() yields one sample's text: use generate() (or the server) for n > 1")
        rid = self.engine.add_request(prompt, sampling_params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.delta_text:
                        yield out.delta_text
                    if out.finished:
                        if out.finish_reason == "error":
                            raise RuntimeError(out.error)
                        done = True
        finally:
            if not done:
                self.engine.abort(rid)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a conversation, with the generation prompt (``prompts.apply_chat_template``:
        what the template raises on the messages is RequestRejected naming ``messages``)."""
        return prompts.apply_chat_template(self.tokenizer, messages, tools)

    def chat_template_source(self, tools: list[dict] | None = None) -> str:
        """The template text ``apply_chat_template`` would use (its tool-use one, given tools)."""
        return prompts.chat_template_source(self.tokenizer, tools)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


class _Progress:
    """A one-line progress bar on stderr: requests done and output tokens/s."""

    def __init__(self, total: int):
        self.total, self.done, self.tokens = total, 0, 0
        self.start = time.perf_counter()

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} requests, {rate:.1f} tok/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
