"""The one home for writing a file atomically and reading one safely (snippets, allow-once tokens, the textfile).

- ``write_atomic``: a new temp file beside the target (``O_CREAT|O_EXCL|O_NOFOLLOW``), every byte written, the
  mode set with ``fchmod``, optionally ``fsync``'d, then renamed over the name: a reader sees the old file or the
  whole new one, and a symlink planted at the name is replaced, never followed. On failure the temp file goes.
- ``open_nofollow`` / ``read_regular``: opened without following a symlink, without blocking on a FIFO and
  without taking a terminal, then checked on the descriptor (no stat-then-open race): only a regular file of at
  most ``limit`` bytes is read.

Both take a directory descriptor (``dir_fd``) so callers that checked a directory once work relative to it.
Manual equivalent: ``install -m 644 new /path`` (which is not atomic) or ``mv -T tmp /path``.
"""

from __future__ import annotations

import os
import stat

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def open_nofollow(name: str, dir_fd: int | None = None) -> int:
    """A read-only descriptor of ``name`` (relative to ``dir_fd``), never through a symlink; raises OSError."""
    return os.open(name, READ_FLAGS, dir_fd=dir_fd)


def read_regular(name: str, dir_fd: int | None = None, limit: int | None = None) -> bytes | None:
    """The bytes of the regular file ``name``, or None when it is absent, unreadable, not a regular file (a link,
    a FIFO, a device) or larger than ``limit``."""
    try:
        fd = open_nofollow(name, dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
            return None
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 16 if limit is None else min(1 << 16, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                return None
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomic(name: str, data: bytes, *, mode: int, dir_fd: int | None = None, fsync: bool = True) -> None:
    """``data`` as ``name`` (relative to ``dir_fd``): temp file, all bytes, ``fchmod(mode)``, fsync, rename."""
    head, base = os.path.split(name)
    tmp = os.path.join(head, f".{base}.pvegpu-{os.getpid()}-{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
