"""Host user names for the uids read from ``/proc`` (manual equivalent: ``getent passwd UID``).

A process in an unprivileged container runs as a host uid its user namespace maps to (100000 and up on PVE),
which usually has no passwd entry: then there is no name, and the number is shown.
"""

from __future__ import annotations

import pwd
from functools import lru_cache

from ..safetext import escape


@lru_cache(maxsize=4096)
def user_name(uid: int) -> str | None:
    """The host's name for ``uid`` (escaped), or None when the host has none."""
    try:
        return escape(pwd.getpwuid(uid).pw_name, 64)
    except (KeyError, OverflowError, ValueError):
        return None
