"""Host user names for the uids read from ``/proc`` (manual equivalent: ``getent passwd UID``).

A process in an unprivileged container runs as a host uid its user namespace maps to (100000 and up on PVE),
which usually has no passwd entry: then there is no name, and the number is shown.
"""

from __future__ import annotations

import pwd

from ..safetext import escape

_CACHE_MAX = 4096  # uids remembered per run (a node's holders have a handful; a run never grows past this)
_names: dict[int, str | None] = {}  # a dict, not functools.lru_cache: functools is ~1 ms of the audit's start-up


def user_name(uid: int) -> str | None:
    """The host's name for ``uid`` (escaped), or None when the host has none (each uid looked up once per run)."""
    if uid in _names:
        return _names[uid]
    try:
        name: str | None = escape(pwd.getpwuid(uid).pw_name, 64)
    except (KeyError, OverflowError, ValueError):
        name = None
    if len(_names) < _CACHE_MAX:
        _names[uid] = name
    return name
