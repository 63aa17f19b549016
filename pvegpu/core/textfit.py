"""Human output that reads in 80 columns: wrapping that keeps a `quoted command` whole, and the telling part
of a command line. Pure text in, text out (already escaped: this never unescapes anything); the ``check`` command uses it on the
start gate's path.
"""

from __future__ import annotations

import textwrap
import unicodedata

WIDTH = 80
_KEEP = "\x00"  # stands for a space inside `...` while wrapping: an escaped text never holds a NUL


def _protect(text: str) -> str:
    parts = text.replace(_KEEP, " ").split("`")
    return "`".join(p.replace(" ", _KEEP) if i % 2 else p for i, p in enumerate(parts))


def columns(text: str) -> int:
    """The terminal columns ``text`` takes: wide and full-width characters (CJK) count 2, combining marks 0."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _cut(text: str, width: int, from_end: bool = False) -> str:
    """The longest start (or end) of ``text`` that takes at most ``width`` columns."""
    if text.isascii():
        return text[len(text) - width:] if from_end and width > 0 else "" if from_end else text[:width]
    out, used = [], 0
    for c in reversed(text) if from_end else text:
        w = columns(c)
        if used + w > width:
            break
        out.append(c)
        used += w
    return "".join(reversed(out) if from_end else out)


def _wrap(text: str, first: str, rest: str, width: int) -> list[str]:
    """textwrap's greedy wrap, measured in terminal columns (for text with wide characters)."""
    lines: list[str] = []
    line, used = first, columns(first)
    fresh = True  # nothing but the indent on this line yet
    for word in text.split():
        w = columns(word)
        if not fresh and used + 1 + w <= width:
            line, used = line + " " + word, used + 1 + w
            continue
        if not fresh:
            lines.append(line)
            line, used = rest, columns(rest)
        while used + w > width and width - used > 0:  # a word wider than a line: break it by columns
            head = _cut(word, width - used) or word[:1]
            lines.append(line + head)
            word = word[len(head):]
            w = columns(word)
            line, used = rest, columns(rest)
        line, used, fresh = line + word, used + w, not word
    if not fresh or not lines:
        lines.append(line)
    return [ln.rstrip() if ln.strip() else ln for ln in lines]


def fit(text: str, first: str = "", rest: str = "    ", width: int = WIDTH) -> list[str]:
    """``text`` as lines of at most ``width`` columns: the first starts with ``first``, the others with ``rest``.
    Breaks at spaces, never inside a `quoted command` unless that alone is wider than a line."""
    if not (text + first + rest).isascii():
        return [line.replace(_KEEP, " ") for line in _wrap(_protect(text), first, rest, width)] or [first.rstrip()]
    lines = textwrap.wrap(_protect(text), width=width, initial_indent=first, subsequent_indent=rest,
                          break_on_hyphens=False, break_long_words=True) or [first.rstrip()]
    return [line.replace(_KEEP, " ") for line in lines]


def said(text: str, first: str = "", rest: str = "    ", wide: bool = False) -> str:
    """``first`` + ``text`` for people, as one string: wrapped to 80 columns by ``fit`` (``rest`` starts each further
    line), never cut; ``wide`` (``--wide``/``-v``): one line."""
    return first + text if wide else "\n".join(fit(text, first, rest))


def elide(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` columns (``...`` where it was cut): the start and the end both show."""
    if columns(text) <= width:
        return text
    if width <= 3:
        return _cut(text, width)
    tail = (width - 3) // 2
    return _cut(text, width - 3 - tail) + "..." + _cut(text, tail, from_end=True)


def command(cmdline: str, comm: str = "", width: int = WIDTH) -> str:
    """The telling part of a command line: the basename of argv[0] and the arguments, elided in the middle to
    ``width`` (``/opt/venv/bin/python3 -m train --data /x`` shows as ``python3 -m train --data /x``)."""
    words = cmdline.split(" ", 1)
    if not cmdline.strip():
        return elide(f"[{comm}]" if comm else "?", width)
    head = words[0].rstrip("/").rsplit("/", 1)[-1] or words[0]
    return elide(head + (" " + words[1] if len(words) > 1 else ""), width)
