"""lightjson.loads: json.loads's answer (or its error) for every text, without importing json on the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pvegpu.lightjson import loads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


def _outcome(fn, text):
    try:
        return ("value", repr(fn(text)))  # repr: NaN is not equal to itself
    except ValueError as exc:
        return ("error", type(exc).__name__, str(exc))


@settings(max_examples=300, deadline=None)
@given(_JSON, st.sampled_from(["", " ", "\n", "\t\r\n ", "\u00a0"]), st.sampled_from(["", " ", "\n\n", "x", " 1", "\u00a0"]))
def test_json_texts_with_any_surroundings_read_as_json_loads_reads_them(value, before, after):
    """A JSON document, with whitespace or junk around it: the same value, or the same error, as json.loads."""
    text = before + json.dumps(value) + after
    assert _outcome(loads, text) == _outcome(json.loads, text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-truefalsnNIiy \n\t\\u\ufeff', max_size=40))
def test_arbitrary_texts_give_json_loads_answer_or_error(text):
    """Any text made of JSON's characters: json.loads's value or json.loads's error (type and words)."""
    assert _outcome(loads, text) == _outcome(json.loads, text)


@pytest.mark.parametrize("text", ["NaN", "[Infinity, -Infinity]", '{"a": 1e400}', '"\\ud800"', "\ufeff{}", "{} {}", "1 2", "[1,]"])
def test_edge_texts_match_json_loads(text):
    """Constants, overflow, lone surrogates, a byte-order mark, extra data and a trailing comma: as json.loads."""
    assert _outcome(loads, text) == _outcome(json.loads, text)


def test_a_valid_text_is_read_without_importing_json():
    """Reading a valid document imports neither json nor re."""
    doc = json.dumps({"ids": {"129": {"node": "n"}}})
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from pvegpu.lightjson import loads; v = loads({' ' + doc + ' '!r}); "
            "print(v['ids']['129']['node'], 'json' in sys.modules, 're' in sys.modules)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["n", "False", "False"], out.stderr
