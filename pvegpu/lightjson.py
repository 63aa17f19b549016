"""``json.loads`` for the start-up paths, without importing ``json``: its decoder and encoder import ``re`` (and with it
``enum``, ``functools``, ``collections``): 3-8 ms of the audit's start-up on the 2-core box, to read ``/etc/pve/.vmlist``.

The text is read by the standard library's own C scanner (``_json.make_scanner``, what ``json.loads`` uses), set up as
``json.JSONDecoder()`` sets it up; surrounding whitespace is the decoder's (space, tab, newline, carriage return). Anything
that is not one JSON value (an error, extra data, a byte-order mark) and an interpreter without the C scanner go to
``json.loads`` itself, so every answer and every error is ``json.loads``'s. One boundary differs: the scanner shares
Python's recursion limit, and is called here a few frames nearer the top of the stack than ``json.loads`` calls it, so
a document nested to within a few levels of that limit (~1,000 arrays deep) may be read where ``json.loads`` raises
``RecursionError``; deeper, both raise it.
"""

from __future__ import annotations

_WHITESPACE = " \t\n\r"
_scanner: list[object] = []  # the C scanner, made once


def _scan() -> object:
    if not _scanner:
        from _json import make_scanner

        class _Decoder:  # the attributes json.JSONDecoder() gives its scanner
            strict = True
            object_hook = None
            object_pairs_hook = None
            parse_float = float
            parse_int = int
            parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__

        _scanner.append(make_scanner(_Decoder()))  # type: ignore[arg-type]  # typeshed wants a JSONDecoder: its attributes are all it reads
    return _scanner[0]


def loads(text: str) -> object:
    """``json.loads(text)``: the same value, or the same error."""
    if isinstance(text, str):
        try:
            scan = _scan()
        except ImportError:  # no C accelerator: json's own Python scanner, through json
            scan = None
        if scan is not None:
            start = len(text) - len(text.lstrip(_WHITESPACE))
            try:
                value, end = scan(text, start)  # type: ignore[operator]
            except (StopIteration, ValueError):  # not a value here: json.loads says why, in its words
                pass
            else:
                if not text[end:].strip(_WHITESPACE):
                    return value
    import json

    return json.loads(text)
