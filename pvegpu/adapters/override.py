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


def pending(override_dir: str, vmid: int, ttl: float) -> bool:
    """Is a fresh, complete token waiting for CT ``vmid``'s next start? (Read only; ``take`` consumes it.)"""
    path = os.path.join(override_dir, str(vmid))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        age = time.time() - os.fstat(fd).st_mtime
        return os.read(fd, 256).decode("ascii", "replace").startswith(MAGIC + " ") and -60 <= age <= ttl
    finally:
        os.close(fd)


def take(override_dir: str, vmid: int, ttl: float) -> str | None:
    """Consume CT ``vmid``'s token if there is a fresh, complete one; returns its description."""
    path = os.path.join(override_dir, str(vmid))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        text = os.read(fd, 256).decode("ascii", "replace")
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except OSError:
        return None  # another start took it first
    age = time.time() - st.st_mtime
    if not text.startswith(MAGIC + " ") or age > ttl or age < -60:
        return None
    return f"{path}, {age:.0f} s old"
