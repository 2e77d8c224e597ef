"""Constraint -> regular expression over the output text (what outlines-core turns into a token DFA).

    json_schema: checked for keywords we cannot honour (400), integer bounds rewritten to exact
        digit-range regexes (outlines-core leaves minimum/maximum unenforced), string
        minLength/maxLength kept (outlines-core counts characters, an escape as one; a
        maxLength costs ~40 K automaton words per character, so the compiler may ask for a
        second regex without the maxLengths: drop_max_length), then
        outlines_core.json_schema.build_regex_from_schema with bounded whitespace ("[ ]?" between
        tokens, no newlines: a small model cannot spin on blanks) and bounded recursion
    json_object: an object whose values are scalars, or flat arrays / objects of scalars
        (outlines-core's generic object nests two levels and takes ~30 s to index)
    regex: as given (the compiler reports one that does not build)
    choice: the literal alternatives, escaped
"""
from __future__ import annotations

import json
from typing import Any

from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, build_regex_from_schema

from .request import Constraint, ConstraintError

WHITESPACE = r"[ ]?"
MAX_RECURSION_DEPTH = 3
MAX_ENUM_RANGE = 1024             # integer bounds spanning at most this many values become a plain alternation

# Keywords a schema may use: what outlines-core honours, what we enforce ourselves (integer bounds),
# and annotations without effect on the text.
_KEYWORDS = frozenset((
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "discriminator", "nullable", "strict", "name"))
_SCHEMA_MAPS = ("properties", "$defs", "definitions")      # values are schemas
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_PLACEHOLDER = "BLINKINT{}"

_PRIMITIVE = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"


def _object(value: str) -> str:
    pair = f"{STRING}{WHITESPACE}:{WHITESPACE}{value}"
    return rf"\{{{WHITESPACE}({pair}({WHITESPACE},{WHITESPACE}{pair})*)?{WHITESPACE}\}}"


def _array(value: str) -> str:
    return rf"\[{WHITESPACE}({value}({WHITESPACE},{WHITESPACE}{value})*)?{WHITESPACE}\]"


JSON_OBJECT = _object(f"({_PRIMITIVE}|{_object(_PRIMITIVE)}|{_array(_PRIMITIVE)})")
_META = set(r"\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """A literal for outlines-core's regex syntax (Rust regex): metacharacters backslashed."""
    return "".join("\\" + c if c in _META else c for c in text)


def to_regex(c: Constraint, drop_max_length: bool = False) -> str:
    if c.kind == "regex":
        return c.source
    if c.kind == "choice":
        return "(" + "|".join(escape(x) for x in json.loads(c.source)) + ")"
    if c.kind == "json_object":
        return JSON_OBJECT
    schema = json.loads(c.source)
    ints: list[str] = []
    schema = _rewrite(schema, c.param, ints, drop_max_length=drop_max_length)
    try:
        rx = build_regex_from_schema(json.dumps(schema), WHITESPACE, MAX_RECURSION_DEPTH)
    except (ValueError, TypeError, RecursionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConstraintError(f"'{c.param}': unsupported or invalid JSON schema: {first}", c.param) from None
    for k, int_rx in enumerate(ints):
        rx = rx.replace(f'"{_PLACEHOLDER.format(k)}"', int_rx)
    return rx


def has_max_length(c: Constraint) -> bool:
    """Whether a JSON-schema constraint bounds a string's length from above."""
    return c.kind == "json_schema" and '"maxLength"' in c.source


def _rewrite(node: Any, where: str, ints: list[str], depth: int = 0, drop_max_length: bool = False) -> Any:
    """A copy of the schema with bounded integers as placeholders; 400 on unknown keywords."""
    if depth > 64:
        raise ConstraintError(f"'{where}': schema nested too deeply", where)
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        raise ConstraintError(f"'{where}': a schema must be an object, got {type(node).__name__}", where)
    for k in node:
        if k not in _KEYWORDS:
            raise ConstraintError(f"'{where}': unsupported JSON schema keyword '{k}'", where)
    if node.get("type") == "integer" and any(k in node for k in ("minimum", "maximum", "exclusiveMinimum",
                                                                  "exclusiveMaximum")):
        ints.append(integer_regex(*_bounds(node, where)))
        return {"const": _PLACEHOLDER.format(len(ints) - 1)}
    if node.get("type") == "number" and any(k in node for k in ("minimum", "maximum", "exclusiveMinimum",
                                                                 "exclusiveMaximum")):
        raise ConstraintError(f"'{where}': bounds on a 'number' are not enforced; use an integer or drop them",
                              where)
    out = dict(node)
    if drop_max_length:
        out.pop("maxLength", None)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {n: _rewrite(s, where, ints, depth + 1, drop_max_length) for n, s in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_rewrite(s, where, ints, depth + 1, drop_max_length) for s in node[key]]
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out[key] = _rewrite(node[key], where, ints, depth + 1, drop_max_length)
    return out


def _bounds(node: dict, where: str) -> tuple[int | None, int | None]:
    import math

    def num(k):
        v = node.get(k)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConstraintError(f"'{where}': '{k}' must be a finite number", where)
        return v
    lo = [x for x in (num("minimum"),) if x is not None] + [
        math.floor(x) + 1 for x in (num("exclusiveMinimum"),) if x is not None]
    hi = [x for x in (num("maximum"),) if x is not None] + [
        math.ceil(x) - 1 for x in (num("exclusiveMaximum"),) if x is not None]
    lo_v = max(math.ceil(x) for x in lo) if lo else None
    hi_v = min(math.floor(x) for x in hi) if hi else None
    if lo_v is not None and hi_v is not None and lo_v > hi_v:
        raise ConstraintError(f"'{where}': integer bounds admit no value ({lo_v} > {hi_v})", where)
    return lo_v, hi_v


def integer_regex(lo: int | None, hi: int | None) -> str:
    """Exactly the decimal integers in [lo, hi] (None: unbounded on that side)."""
    if lo is not None and hi is not None and hi - lo < MAX_ENUM_RANGE:
        return "(" + "|".join(str(i) for i in range(lo, hi + 1)) + ")"
    parts = []
    if lo is None or lo < 0:               # negative part: -[max(1, -hi), -lo]
        neg_hi = None if lo is None else -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        parts.append("-" + _nonneg(neg_lo, neg_hi))
    if hi is None or hi >= 0:
        parts.append(_nonneg(max(0, lo) if lo is not None else 0, hi))
    return "(" + "|".join(parts) + ")"


def _nonneg(lo: int, hi: int | None) -> str:
    """Integers in [lo, hi], lo >= 0, hi None = unbounded; no leading zeros."""
    parts = []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    for d in range(len(str(lo)), len(str(top)) + 1):
        a, b = max(lo, 10 ** (d - 1) if d > 1 else 0), min(top, 10 ** d - 1)
        if a <= b:
            parts += _same_length(str(a), str(b))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "(" + "|".join(parts) + ")"


def _same_length(a: str, b: str) -> list[str]:
    """Digit strings from a to b (same length, a <= b) as regex alternatives."""
    n = len(a)
    if a == b:
        return [a]
    if n == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + x for x in _same_length(a[1:], b[1:])]
    out = [a[0] + x for x in _same_length(a[1:], "9" * (n - 1))]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}][0-9]{{{n - 1}}}")
    out += [b[0] + x for x in _same_length("0" * (n - 1), b[1:])]
    return out
