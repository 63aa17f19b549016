"""The one-start override of the start gate: ``pvegpu hook allow-once VMID`` drops a token file that the
next ``pre-start`` of that container consumes.

Manual equivalent: ``echo > /run/pvegpu/allow-once/129`` (but written atomically, never through a link,
and only honoured while fresh and complete).
"""

from __future__ import annotations

import os
import time

MAGIC = "pvegpu-allow-once"


def allow_once(override_dir: str, vmid: int) -> str:
    """Write CT ``vmid``'s token atomically (a partial token is never seen); returns its path."""
    os.makedirs(override_dir, mode=0o700, exist_ok=True)
    path = os.path.join(override_dir, str(vmid))
    tmp = os.path.join(override_dir, f".{vmid}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        data = f"{MAGIC} {time.time():.0f} uid={os.getuid()}\n".encode()
        if os.write(fd, data) != len(data):
            raise OSError("short write")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return path


def _age_if_valid(path: str, ttl: float) -> float | None:
    """The token's age in seconds if it is a complete token (magic prefix) no older than ``ttl``; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        age = time.time() - os.fstat(fd).st_mtime
        complete = os.read(fd, 256).decode("ascii", "replace").startswith(MAGIC + " ")
    finally:
        os.close(fd)
    return age if complete and -60 <= age <= ttl else None


def pending(override_dir: str, vmid: int, ttl: float) -> bool:
    """Is a fresh, complete token waiting for CT ``vmid``'s next start? (Read only; ``take`` consumes it.)"""
    return _age_if_valid(os.path.join(override_dir, str(vmid)), ttl) is not None


def take(override_dir: str, vmid: int, ttl: float) -> str | None:
    """Consume CT ``vmid``'s token if there is a fresh, complete one; returns its description."""
    path = os.path.join(override_dir, str(vmid))
    if not os.path.lexists(path):
        return None
    age = _age_if_valid(path, ttl)
    try:
        os.unlink(path)  # consumed whatever it held: a stale or partial token is not left for later
    except OSError:
        return None  # another start took it first
    return None if age is None else f"{path}, {age:.0f} s old"
