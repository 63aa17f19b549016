"""Validate pvegpu's JSON documents against the JSON Schemas shipped in the package (pvegpu/data/schema/)."""

from __future__ import annotations

import json
import os
from functools import cache

import jsonschema

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pvegpu", "data", "schema")


@cache
def schema(kind: str) -> dict:
    with open(os.path.join(SCHEMA_DIR, f"{kind}.json"), encoding="utf-8") as f:
        s = json.load(f)
    jsonschema.Draft202012Validator.check_schema(s)
    return s


def validate(doc: dict, kind: str | None = None) -> dict:
    """``doc`` checked against the schema its ``schema`` field names (``pvegpu-<kind>``), which must be ``kind`` if given."""
    name = str(doc.get("schema", ""))
    assert name.startswith("pvegpu-"), f"not a pvegpu document: schema={name!r}"
    if kind is not None:
        assert name == f"pvegpu-{kind}", (name, kind)
    errors = sorted(jsonschema.Draft202012Validator(schema(name.removeprefix("pvegpu-"))).iter_errors(doc), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    return doc
