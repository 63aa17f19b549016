"""Human output that reads in 80 columns: wrapping that keeps a `quoted command` whole, and the telling part
of a command line. Pure text in, text out (already escaped: this never unescapes anything); import-light, the
``check`` command uses it on the start gate's path.
"""

from __future__ import annotations

import textwrap

WIDTH = 80
_KEEP = "\x00"  # stands for a space inside `...` while wrapping: an escaped text never holds a NUL


def _protect(text: str) -> str:
    parts = text.replace(_KEEP, " ").split("`")
    return "`".join(p.replace(" ", _KEEP) if i % 2 else p for i, p in enumerate(parts))


def fit(text: str, first: str = "", rest: str = "    ", width: int = WIDTH) -> list[str]:
    """``text`` as lines of at most ``width`` columns: the first starts with ``first``, the others with ``rest``.
    Breaks at spaces, never inside a `quoted command` unless that alone is wider than a line."""
    lines = textwrap.wrap(_protect(text), width=width, initial_indent=first, subsequent_indent=rest,
                          break_on_hyphens=False, break_long_words=True) or [first.rstrip()]
    return [line.replace(_KEEP, " ") for line in lines]


def elide(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` columns (``...`` where it was cut): the start and the end both show."""
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    tail = (width - 3) // 2
    return text[: width - 3 - tail] + "..." + text[len(text) - tail:]


def command(cmdline: str, comm: str = "", width: int = WIDTH) -> str:
    """The telling part of a command line: the basename of argv[0] and the arguments, elided in the middle to
    ``width`` (``/opt/venv/bin/python3 -m train --data /x`` shows as ``python3 -m train --data /x``)."""
    words = cmdline.split(" ", 1)
    if not cmdline.strip():
        return elide(f"[{comm}]" if comm else "?", width)
    head = words[0].rstrip("/").rsplit("/", 1)[-1] or words[0]
    return elide(head + (" " + words[1] if len(words) > 1 else ""), width)
