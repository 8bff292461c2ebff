"""Bounds on the JSON a schema's grammar lets a model write, so constrained JSON always ends.

xgrammar's grammar for a JSON schema leaves numbers and strings unbounded: an integral part is
``[1-9] [0-9]*``, a fraction or exponent ``digits{1, -1}``, a string without ``maxLength`` a
recursive rule. A small model that starts writing ``123.000000000000001230000...`` is then
allowed to go on until ``max_tokens`` and never closes the object. This pass rewrites the
grammar's text with bounds (llama.cpp's JSON-schema grammars bound numbers the same way):

- integral part: at most ``INTEGRAL_DIGITS`` digits; fraction: ``FRACTION_DIGITS``; exponent:
  ``EXPONENT_DIGITS`` (float64 goes no further than 1e308, and 17 significant digits);
- a string without ``maxLength``: at most ``STRING_CHARACTERS`` characters (an escape is one);
- whitespace: none is free already (the schema is compiled compact, ``any_whitespace=False``).

A schema's own bounds win: ``maxLength``, ``maximum``/``minimum`` ranges and ``pattern`` come
out of xgrammar as bounded rules, which this pass leaves alone; it only touches unbounded ones.
Arrays and objects keep any number of items (a schema bounds them with ``maxItems``).
"""

from __future__ import annotations

import re

INTEGRAL_DIGITS = 15
FRACTION_DIGITS = 16
EXPONENT_DIGITS = 3
STRING_CHARACTERS = 2048

_RULE = re.compile(r"^(\w+) ::= (.*)$")
_DIGIT_BODY = "(([0-9]))"
_STRING_CHARACTER_BODY = '(([^\\"\\\\\\r\\n]))'  # xgrammar's one character of a string property


def bounded_json_ebnf(ebnf: str) -> str:
    """xgrammar's EBNF text of a JSON schema (``str(Grammar.from_json_schema(...))``) with the
    bounds above on every unbounded number and string."""
    lines = ebnf.splitlines()
    digit_rules, character_rules = set(), set()
    for line in lines:
        m = _RULE.match(line)
        if m and m.group(2) == _DIGIT_BODY:
            digit_rules.add(m.group(1))
        elif m and m.group(2) == _STRING_CHARACTER_BODY:
            character_rules.add(m.group(1))
    out = []
    for line in lines:
        if line.startswith("basic_string_sub ::= "):
            out.extend(_bounded_string_rules())
            continue
        out.append(_bounded_repeats(line, digit_rules, character_rules))
    return "\n".join(out) + "\n"


def _bounded_string_rules() -> list[str]:
    """A JSON string's body and closing quote, one character (or escape) at a time, at most
    ``STRING_CHARACTERS`` of them: xgrammar's recursive rule, made finite."""
    return [
        f'basic_string_sub ::= basic_string_character{{0, {STRING_CHARACTERS}}} "\\""',
        'basic_string_character ::= [^\\0-\\x1f\\"\\\\\\r\\n] | ("\\\\" basic_escape)',
    ]


def _bounded_repeats(line: str, digit_rules: set[str], character_rules: set[str]) -> str:
    """One rule with its unbounded digit and character repeats bounded."""
    line = line.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {INTEGRAL_DIGITS - 1}}}")

    def bound(m: re.Match) -> str:
        name, least, before = m.group(1), int(m.group(2)), m.string[: m.start()]
        if name in character_rules:
            most = STRING_CHARACTERS
        elif name not in digit_rules:
            return m.group(0)  # an array's items or an object's properties: the schema's to bound
        elif before.endswith('"." '):
            most = FRACTION_DIGITS
        elif re.search(r"\[eE\] \w+ $", before):
            most = EXPONENT_DIGITS
        else:
            most = INTEGRAL_DIGITS - 1  # after the leading [1-9]
        return f"{name}{{{least}, {max(least, most)}}}"

    return re.sub(r"\b(\w+)\{(\d+), -1\}", bound, line)
