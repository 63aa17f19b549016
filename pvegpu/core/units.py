"""The one home for showing byte counts in MiB (reset, gate, diagnosis, audit: the same rounding everywhere).

Unknown is never zero: ``None`` is shown as the caller's word for unknown (``unknown``, ``?``) or stays ``None``.
"""

from __future__ import annotations

from pvegpu.core.model import MIB


def whole_mib(n: int | float | None) -> int | None:
    """``n`` bytes as whole MiB (rounded half to even, as ``round``), or None when unknown."""
    return None if n is None else round(n / MIB)


def mib_figure(n: int | float | None, unknown: str = "?") -> str:
    """``n`` bytes as a bare whole-MiB figure (``2048``), or ``unknown``."""
    v = whole_mib(n)
    return unknown if v is None else str(v)


def mib(n: int | float | None, unknown: str = "unknown", *, grouped: bool = False) -> str:
    """``n`` bytes as ``2048 MiB`` (``2,048 MiB`` when ``grouped``: every figure of a reset's screen, its table,
    its wait lines, its steps and its diagnosis, is grouped), or ``unknown``."""
    v = whole_mib(n)
    if v is None:
        return unknown
    return f"{v:,} MiB" if grouped else f"{v} MiB"
