"""The tokenizer of an HF directory with a ``tokenizer.json``, without importing transformers.

Why: ``LLM(memory=...)`` bounds the whole process, and importing transformers to load a tokenizer
costs ~67 MiB resident in every process, for work done elsewhere: the Rust ``tokenizers`` library
encodes and decodes, jinja2's sandbox renders the chat template. This module drives those two
directly and reproduces what ``PreTrainedTokenizerFast.from_pretrained`` (transformers 5.x) and its
``apply_chat_template`` do with the same files; ``tests/test_tokenizer.py`` holds the two equal.

What transformers adds that is copied here, because outputs change without it:
- special tokens named in ``tokenizer_config.json`` (and, when that file has no
  ``added_tokens_decoder``, in the legacy ``special_tokens_map.json``) that ``tokenizer.json``
  does not know as added tokens are added to it, so their text encodes as one token;
- truncation and padding saved in ``tokenizer.json`` are switched off, as every encode there does;
- ``clean_up_tokenization_spaces`` applies to decoded text, except for BPE models, where it would
  delete real spaces before punctuation;
- the chat template comes from ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``)
  when present, else from ``tokenizer_config.json``; ``chat_template.json`` is a processor's file,
  which a tokenizer never reads. It renders with the same environment, helpers and variables.

Left out, because pagedllm never asks for them: batches, pairs, padding, truncation, tensors,
assistant masks, ``continue_final_message``, tools given as Python functions.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from ..memory.machine import return_freed_heap

# transformers' named special tokens; any other ``*_token`` string in the config joins them.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Text <-> token ids and chat messages -> prompt text, for one model directory."""

    def __init__(self, backend: RustTokenizer, config: Mapping[str, Any], special_tokens_map: Mapping[str, Any]):
        self.backend = backend
        named, extra = _special_tokens(config, special_tokens_map)
        _add_missing_tokens(backend, config, named, extra)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        backend.no_truncation()
        backend.no_padding()
        # The template sees every named special token by name, as plain text.
        self.special_tokens: dict[str, str] = {name: _content(tok) for name, tok in named.items()}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )
        self.chat_template: str | dict[str, str] | None = _as_templates(config.get("chat_template"))

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        config = _read_json(model_dir / "tokenizer_config.json")
        tokenizer = cls(
            RustTokenizer.from_file(str(model_dir / "tokenizer.json")),
            config,
            {} if "added_tokens_decoder" in config else _read_json(model_dir / "special_tokens_map.json"),
        )
        templates = _template_files(model_dir)
        if templates:  # files take priority over the config's entry, as in transformers
            tokenizer.chat_template = templates["default"] if list(templates) == ["default"] else templates
        return_freed_heap()  # parsing tokenizer.json freed about as much heap as the tokenizer keeps
        return tokenizer

    # ---- special tokens -------------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    def _token_id(self, token: str | None) -> int | None:
        """A token's id; one missing from the vocabulary reads as the unknown token, as in transformers."""
        if token is None:
            return None
        found = self.backend.token_to_id(token)
        if found is None and token != self.special_tokens.get("unk_token"):
            return self._token_id(self.special_tokens.get("unk_token"))
        return found

    # ---- text <-> ids -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies ``tokenizer.json``'s post-processor
        (e.g. a leading BOS). Note transformers defaults it to True; pagedllm never wants it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(
            [ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens
        )
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    # ---- chat -------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The prompt the model's chat template writes for ``messages`` (its ids when ``tokenize``).

        Templates ship with model files and may be hostile, so they render in jinja2's immutable
        sandbox over plain copies of the inputs: a template can neither escape to Python nor edit
        the caller's messages. Its errors propagate; ``range()`` is capped by the sandbox."""
        if kwargs.get("continue_final_message"):
            raise NotImplementedError("continue_final_message is not supported")
        template = self.pick_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be dicts with 'title' and 'text' keys")
        text = _compile(template).render(
            messages=_chat_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain({**self.special_tokens, **kwargs}),  # the caller's variables win
        )
        return self.encode(text) if tokenize else text

    def pick_template(self, name_or_source: str | None, tools: list | None) -> str:
        """transformers' choice: a named template, else the model's (its "tool_use" one when tools are given)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if name_or_source is not None:
                return templates.get(name_or_source, name_or_source)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this model has several chat templates and none is the default: {sorted(templates)}")
        template = name_or_source if name_or_source is not None else templates
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return template


# ---- loading ------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: expected a JSON object")
    return data


def _token(value: Any, special: bool | None = None) -> str | AddedToken | None:
    """A special token as the config writes it: a string, or a dict of AddedToken fields."""
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        fields = {k: v for k, v in value.items() if k not in ("__type", "special")}
        return AddedToken(**fields, special=value.get("special", False) if special is None else special)
    return value if isinstance(value, str) else None


def _content(token: str | AddedToken) -> str:
    return token if isinstance(token, str) else token.content


def _special_tokens(
    config: Mapping[str, Any], legacy_map: Mapping[str, Any]
) -> tuple[dict[str, str | AddedToken], list[str | AddedToken]]:
    """(named special tokens, extra special tokens) from the config, then the legacy map over it."""
    named: dict[str, str | AddedToken] = {}
    extra: list[str | AddedToken] = []

    def take(source: Mapping[str, Any], special: bool | None) -> None:
        for key, value in source.items():
            if key in NAMED_SPECIAL_TOKENS or key.endswith("_token"):
                token = _token(value, special)
                if token is not None:
                    named[key] = token
        listed = source.get("extra_special_tokens") or source.get("additional_special_tokens")
        if isinstance(listed, Mapping):  # named model-specific tokens, e.g. {"image_token": "<image>"}
            named.update({k: t for k, v in listed.items() if (t := _token(v, special)) is not None})
        elif isinstance(listed, list):
            extra.extend(t for v in listed if (t := _token(v, True)) is not None and t not in extra)

    take(config, None)
    take(legacy_map, True)
    return named, extra


def _add_missing_tokens(
    backend: RustTokenizer,
    config: Mapping[str, Any],
    named: Mapping[str, str | AddedToken],
    extra: list[str | AddedToken],
) -> None:
    """Adds to the Rust tokenizer the config's added tokens and the special tokens it lacks."""
    known = backend.get_added_tokens_decoder().values()
    known_reprs, known_contents = {repr(t) for t in known}, {t.content for t in known}
    decoder = config.get("added_tokens_decoder") or {}
    to_add = [t for _, d in sorted(decoder.items(), key=lambda kv: int(kv[0])) if (t := _token(d)) is not None]
    to_add = [t for t in to_add if repr(t) not in known_reprs]
    contents = known_contents | {_content(t) for t in to_add}
    named_contents = {_content(t) for t in named.values()}
    for token in [*named.values(), *extra]:
        if _content(token) in contents:
            continue
        contents.add(_content(token))
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif _content(token) in named_contents:
            token.special = True
        to_add.append(token)
    if to_add:
        backend.add_tokens(to_add)


def _as_templates(value: Any) -> str | dict[str, str] | None:
    """A config's chat template: one string, or a list of {"name", "template"} made a dict."""
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value


def _template_files(model_dir: Path) -> dict[str, str]:
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    return templates


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: undoes the spaces WordPiece puts before punctuation."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(spaced, joined)
    for suffix in ("m", "s", "ve", "re"):
        text = text.replace(" '" + suffix, "'" + suffix)
    return text


# ---- rendering ----------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A copy of ``value`` made only of JSON types, which the sandbox knows to be harmless; anything
    else becomes a placeholder naming its type. Subclasses of str/int/float (enums, ...) drop to
    the base type, so a template never reaches a method the sandbox was not written for."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# Names a message's reasoning comes under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Plain copies of the messages, as transformers hands them to the template: keys whose value is
    None dropped (templates print "None" for them), reasoning under both names templates read."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    return _environment().from_string(source)


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The environment transformers renders chat templates in, so a template prints the same text:
    the immutable sandbox, trimmed blocks, ``break``/``continue``, a ``tojson`` that keeps non-ASCII
    text and takes ``indent``, and the helpers templates call. jinja2 is imported here, on the first
    chat, not with the module."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag(jinja2)]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _namespace_class(jinja2)
    return env


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


class _DictMaker:
    """``dict(...)`` for templates: builds dicts, and offers nothing of the ``dict`` type to climb."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _namespace_class(jinja2: Any) -> type:
    """jinja2's ``namespace``, refusing attribute names with a leading underscore: a template could
    otherwise store over the object's internals."""

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _generation_tag(jinja2: Any) -> type:
    """``{% generation %}...{% endgeneration %}``, which training templates wrap assistant turns in
    to mark them for loss masks: rendered as its body, since serving needs no mask."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return Generation
