"""A deterministic suite of JSON schemas for structured-output validity checks.

:func:`schemas` returns the same 120 ``(name, schema)`` pairs on every machine, built from
fixed building blocks, ten of each family: flat objects, arrays, enums, nested objects,
``anyOf``, string patterns, numeric ranges, required/optional mixes, ``const`` / booleans /
nulls, and composite "API response" shapes. Strings carry a ``maxLength`` and arrays a
``maxItems`` so that every schema has outputs within a few hundred tokens (a model that
writes at random, like stories260K, must be able to finish inside its token budget).

``python benchmarks/json_schema_suite.py OUT_DIR`` writes them as ``OUT_DIR/NNN_name.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["schemas"]

_WORDS = ["cat", "dog", "red", "blue", "sun", "moon", "tree", "ball", "park", "star", "fish", "bird"]


def _string(i: int) -> dict:
    return {"type": "string", "maxLength": 4 + i % 9}


def _int(i: int) -> dict:
    return {"type": "integer", "minimum": -(i % 3) * 10, "maximum": 10 + i * 7}


def _number(i: int) -> dict:
    # multipleOf bounds the fraction digits (a power of two: jsonschema checks it in floats,
    # where 9.2 is no multiple of 0.01); a plain "number" lets a random model write
    # digits until max_tokens (a valid prefix forever), which ends with "length"
    return {"type": "number", "minimum": 0, "maximum": 1 + i, "multipleOf": 0.25}


def _enum(i: int) -> dict:
    return {"enum": _WORDS[i % 7 : i % 7 + 2 + i % 4]}


def _object(props: dict, required=None, extra=False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": extra}


def schemas() -> list[tuple[str, dict]]:
    """The suite: 120 ``(name, schema)`` pairs, in a fixed order."""
    out: list[tuple[str, dict]] = []
    for i in range(10):  # flat objects of scalars
        props = {"name": _string(i), "count": _int(i), "ok": {"type": "boolean"}}
        if i % 2:
            props["score"] = _number(i)
        out.append((f"flat_object_{i}", _object(props)))
    for i in range(10):  # arrays
        items = [_string(i), _int(i), _enum(i), {"type": "boolean"}, _object({"id": _int(i)})][i % 5]
        out.append((f"array_{i}", {"type": "array", "items": items, "minItems": i % 3, "maxItems": 2 + i % 4}))
    for i in range(10):  # enums
        values = _WORDS[i : i + 2 + i % 5] or _WORDS[:3]
        schema = {"enum": values} if i % 2 == 0 else _object({"color": {"enum": values}, "size": {"enum": [1, 2, 3, i + 4]}})
        out.append((f"enum_{i}", schema))
    for i in range(10):  # nested objects
        inner = _object({"street": _string(i), "number": _int(i)})
        middle = _object({"address": inner, "tags": {"type": "array", "items": _enum(i), "maxItems": 3}})
        out.append((f"nested_{i}", _object({"person": _object({"name": _string(i), "home": middle if i % 2 else inner})})))
    for i in range(10):  # anyOf
        variants = [_string(i), _int(i), _object({"kind": {"const": "a"}, "value": _int(i)}), {"type": "null"},
                    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}]
        pick = [variants[(i + k) % 5] for k in range(2 + i % 3)]
        out.append((f"any_of_{i}", _object({"value": {"anyOf": pick}})))
    patterns = [r"^[a-z]{3,8}$", r"^[0-9]{3}-[0-9]{4}$", r"^[A-Z][a-z]{1,6}$", r"^(yes|no|maybe)$", r"^#[0-9a-f]{6}$",
                r"^[a-z]{1,8}@[a-z]{1,8}\.(com|org)$", r"^v[0-9]\.[0-9]{1,2}$", r"^[A-Z]{2}[0-9]{2}$", r"^(cat|dog)-[0-9]{1,3}$",
                r"^[a-c]{2,4}x?$"]
    for i, pat in enumerate(patterns):  # string patterns
        out.append((f"pattern_{i}", _object({"code": {"type": "string", "pattern": pat}, "note": _string(i)}, required=["code"])))
    for i in range(10):  # numeric ranges
        props = {"small": {"type": "integer", "minimum": i, "maximum": i + 3},
                 "big": {"type": "integer", "minimum": 1000 * i, "maximum": 1000 * i + 999},
                 "negative": {"type": "integer", "minimum": -50 - i, "maximum": -1},
                 "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}}
        if i % 3 == 0:
            props["exclusive"] = {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10 + i}
        out.append((f"numeric_{i}", _object(props)))
    for i in range(10):  # required and optional fields
        props = {"a": _string(i), "b": _int(i), "c": {"type": "boolean"}, "d": _enum(i), "e": _number(i)}
        required = [k for j, k in enumerate(props) if (i >> (j % 4)) & 1] or ["a"]
        out.append((f"optional_{i}", _object(props, required=required)))
    for i in range(10):  # const, booleans, nulls, nullable fields
        props = {"version": {"const": i}, "flag": {"type": "boolean"}, "nothing": {"type": "null"},
                 "maybe": {"type": ["string", "null"], "maxLength": 5}}
        out.append((f"const_bool_null_{i}", _object(props)))
    for i in range(10):  # composite API-like responses
        item = _object({"id": _int(i), "title": _string(i), "status": {"enum": ["open", "closed", "draft"]},
                        "labels": {"type": "array", "items": _enum(i), "maxItems": 2}}, required=["id", "status"])
        out.append((f"api_{i}", _object({"ok": {"type": "boolean"}, "items": {"type": "array", "items": item, "maxItems": 2},
                                          "page": {"type": "integer", "minimum": 1, "maximum": 9}})))
    for i in range(10):  # top-level scalars and small tuples
        schema = [_string(i), _int(i), {"type": "boolean"}, _enum(i), _number(i),
                  {"type": "array", "prefixItems": [_int(i), _string(i)], "items": False, "minItems": 2},
                  {"type": "string", "pattern": r"^[a-z]{2,5}$"}, {"type": "null"},
                  {"type": "array", "items": _number(i), "maxItems": 2}, {"anyOf": [_int(i), {"type": "boolean"}]}][i]
        out.append((f"scalar_{i}", schema))
    for i in range(10):  # deeper nesting with arrays of objects
        leaf = _object({"x": _int(i), "y": _int(i + 1)})
        out.append((f"deep_{i}", _object({"grid": {"type": "array", "items": {"type": "array", "items": leaf, "maxItems": 2},
                                                   "maxItems": 2}, "name": _string(i)}, required=["grid"])))
    return out


def main(argv=None) -> int:
    """Write the suite to a folder (one file per schema)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python benchmarks/json_schema_suite.py OUT_DIR", file=sys.stderr)
        return 2
    folder = Path(args[0])
    folder.mkdir(parents=True, exist_ok=True)
    for n, (name, schema) in enumerate(schemas()):
        (folder / f"{n:03d}_{name}.json").write_text(json.dumps(schema, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
