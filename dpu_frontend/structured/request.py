"""Structured-output parameters of a request -> one Constraint (or None), with OpenAI's and vLLM's shapes.

    response_format {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}
    structured_outputs {json | regex | choice | grammar | json_object, whitespace_pattern}   (vLLM)
    guided_json | guided_regex | guided_choice | guided_grammar (+ guided_whitespace_pattern)  (older vLLM)
      -> Constraint(kind, source, param): source is canonical text (a schema as sorted JSON), so
         equal constraints share one compiled automaton (compiler.py's cache)

At most one constraint per request; a malformed one raises ConstraintError naming the
parameter (the API layer turns it into a 400). No I/O, no compiling here.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

KEYS = frozenset(("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend"))
MAX_SOURCE_CHARS = 1 << 16      # a schema, regex or choice list of at most 64 KiB of text
MAX_CHOICES = 256


class ConstraintError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str            # "json_schema" | "json_object" | "regex" | "choice"
    source: str          # the schema as sorted JSON, the regex, the choices as a JSON list; "" for json_object
    param: str           # where it came from, for error messages


def parse(body: dict[str, Any]) -> Constraint | None:
    """The request's constraint (body holds at least one of KEYS)."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        c = _response_format(rf)
        if c is not None:
            found.append(c)
    so = body.get("structured_outputs")
    if so is not None:
        c = _structured_outputs(so)
        if c is not None:
            found.append(c)
    for key, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        v = body.get(key)
        if v is not None:
            found.append(_one(kind, v, key))
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise ConstraintError("'guided_decoding_backend' must be a string", "guided_decoding_backend")
    ws = body.get("guided_whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise ConstraintError("'guided_whitespace_pattern' must be a string", "guided_whitespace_pattern")
    if len(found) > 1:
        raise ConstraintError(f"at most one structured-output constraint per request; got {found[0].param} and "
                              f"{found[1].param}", found[1].param)
    return found[0] if found else None


def _response_format(rf: Any) -> Constraint | None:
    if not isinstance(rf, dict):
        raise ConstraintError("'response_format' must be an object", "response_format")
    kind = rf.get("type")
    extra = [k for k in rf if k not in ("type", "json_schema")]
    if extra:
        raise ConstraintError(f"unsupported field 'response_format.{extra[0]}'", f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", "response_format")
    if kind != "json_schema":
        raise ConstraintError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                              "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ConstraintError("'response_format.json_schema' must be an object", "response_format.json_schema")
    for k in js:
        if k not in ("name", "schema", "strict", "description"):
            raise ConstraintError(f"unsupported field 'response_format.json_schema.{k}'",
                                  f"response_format.json_schema.{k}")
    if not isinstance(js.get("name"), str):
        raise ConstraintError("'response_format.json_schema.name' is required (a string)",
                              "response_format.json_schema.name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ConstraintError("'response_format.json_schema.strict' must be a boolean",
                              "response_format.json_schema.strict")
    schema = js.get("schema")
    if schema is None:
        return Constraint("json_object", "", "response_format.json_schema")
    return _one("json_schema", schema, "response_format.json_schema.schema")


_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _structured_outputs(so: Any) -> Constraint | None:
    if not isinstance(so, dict):
        raise ConstraintError("'structured_outputs' must be an object", "structured_outputs")
    found = []
    for k, v in so.items():
        if v is None:
            continue
        where = f"structured_outputs.{k}"
        if k in _SO_KINDS:
            found.append(_one(_SO_KINDS[k], v, where))
        elif k == "json_object":
            if not isinstance(v, bool):
                raise ConstraintError(f"'{where}' must be a boolean", where)
            if v:
                found.append(Constraint("json_object", "", where))
        elif k in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(v, bool):
                raise ConstraintError(f"'{where}' must be a boolean", where)
        elif k == "whitespace_pattern":
            if not isinstance(v, str):
                raise ConstraintError(f"'{where}' must be a string", where)
        else:
            raise ConstraintError(f"unsupported field '{where}'", where)
    if len(found) > 1:
        raise ConstraintError("'structured_outputs' takes one of json, regex, choice, grammar, json_object",
                              "structured_outputs")
    return found[0] if found else None


def _one(kind: str, v: Any, param: str) -> Constraint:
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ConstraintError(f"'{param}' is not valid JSON: {e}", param) from None
        if not isinstance(v, dict):
            raise ConstraintError(f"'{param}' must be a JSON schema object", param)
        source = json.dumps(v, sort_keys=True, separators=(",", ":"))
    elif kind in ("regex", "grammar"):
        if not isinstance(v, str) or not v:
            raise ConstraintError(f"'{param}' must be a non-empty string", param)
        if kind == "grammar":
            raise ConstraintError(f"'{param}': grammar constraints are not supported (the constraint compiler, "
                                  "outlines-core, takes regular languages: use json, regex or choice)", param)
        source = v
    else:   # choice
        if (not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v)):
            raise ConstraintError(f"'{param}' must be a non-empty list of non-empty strings", param)
        if len(v) > MAX_CHOICES:
            raise ConstraintError(f"'{param}' has {len(v)} choices; at most {MAX_CHOICES} are allowed", param)
        source = json.dumps(v)
    if len(source) > MAX_SOURCE_CHARS:
        raise ConstraintError(f"'{param}' is {len(source)} characters; at most {MAX_SOURCE_CHARS} are allowed", param)
    return Constraint(kind, source, param)
