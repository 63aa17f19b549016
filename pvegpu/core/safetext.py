"""Make tenant text (process names, command lines, cgroup names) safe to show anywhere.

A tenant chooses its process names and cgroup names; printed raw they could move the cursor, clear a
terminal, fake log lines or break JSON consumers. ``escape`` writes every control or non-printable
character the way Python's ``repr`` does inside the quotes (``\\xNN``, ``\\uNNNN``, ``\\UNNNNNNNN``) and
doubles the backslash, so the result is plain printable text and the original can be read back from
it. Bytes that are not UTF-8 come out as ``\\xNN``. Decisions never use escaped text: adapters parse
the raw bytes first and escape only what they report.
"""

from __future__ import annotations

_SURROGATE_LO, _SURROGATE_HI = 0xDC80, 0xDCFF  # bytes decoded with surrogateescape


def _one(ch: str) -> str:
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if ch.isprintable():
        return ch
    if _SURROGATE_LO <= code <= _SURROGATE_HI:
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str | bytes, limit: int | None = None) -> str:
    """``text`` with control and non-printable characters escaped; cut to ``limit`` characters (then ``...``)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    if text.isascii() and text.isprintable() and "\\" not in text:  # fast path: nothing to escape, one char each
        if limit is None or len(text) <= limit:
            return text
        if limit >= 0:
            return text[:limit] + "..."
    return each_escaped(text, limit)


def each_escaped(text: str, limit: int | None = None) -> str:
    """``escape`` without its fast path: every character through ``_one`` (the reference its fast path equals)."""
    out: list[str] = []
    size = 0
    for ch in text:
        piece = _one(ch)
        if limit is not None and size + len(piece) > limit:
            out.append("...")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)


def shown(text: object, limit: int | None = None) -> str:
    """``text`` as it may be shown: unchanged when already printable (and within ``limit``), else ``escape``d.

    For text that may have been escaped once already (another node's audit, a document read back): printable
    text is not escaped a second time, anything else is, so a terminal never sees a control character."""
    s = text if isinstance(text, str | bytes) else str(text)
    if isinstance(s, str) and s.isprintable() and (limit is None or len(s) <= limit):
        return s
    return escape(s, limit)
