"""Host user names for the uids read from ``/proc`` (manual equivalent: ``getent passwd UID``).

A process in an unprivileged container runs as a host uid its user namespace maps to (100000 and up on PVE),
which usually has no passwd entry: then there is no name, and the number is shown.
"""

from __future__ import annotations

import functools
import pwd

from pvegpu.core.safetext import escape


@functools.lru_cache(maxsize=4096)  # uids remembered per run (a node's holders have a handful)
def user_name(uid: int) -> str | None:
    """The host's name for ``uid`` (escaped), or None when the host has none (each uid looked up once per run)."""
    try:
        return escape(pwd.getpwuid(uid).pw_name, 64)
    except (KeyError, OverflowError, ValueError):
        return None
