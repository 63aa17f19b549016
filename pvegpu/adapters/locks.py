"""One pvegpu reset per container at a time: ``flock`` on ``<lock_dir>/<vmid>.lock``.

Manual equivalent: ``flock -w 10 /run/lock/pvegpu/129.lock pvegpu reset 129``. The lock lives as long as
the process holds the file open, so a killed reset never leaves a stale lock behind. The start gate only
tests it (``reset_running``), and says "reset in progress" instead of judging a half-done state.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from ..errors import BusyError, UsageError


def _path(lock_dir: str, vmid: int) -> str:
    return os.path.join(lock_dir, f"{vmid}.lock")


class ct_lock:  # noqa: N801 - used as ``with ct_lock(dir, 129, wait):``
    """Exclusive lock of CT ``vmid``; waits up to ``wait`` seconds, then raises BusyError naming the holder."""

    def __init__(self, lock_dir: str, vmid: int, wait: float) -> None:
        self.lock_dir, self.vmid, self.wait = lock_dir, vmid, wait
        self.fd = -1

    def __enter__(self) -> ct_lock:
        try:
            os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
            self.fd = os.open(_path(self.lock_dir, self.vmid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise UsageError(f"cannot take the reset lock {_path(self.lock_dir, self.vmid)}: {exc.strerror}",
                             "run pvegpu as root, or set reset.lock_dir to a directory it may write") from None
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                holder = _holder(self.fd)
                os.close(self.fd)
                raise BusyError(f"another pvegpu reset of CT {self.vmid} is running{holder}; gave up after {self.wait:g} s",
                                "let it finish (it has its own deadline), then check with `pvegpu check %d`" % self.vmid)
            time.sleep(0.05)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing releases the flock
            self.fd = -1


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def reset_running(lock_dir: str, vmid: int) -> bool:
    """Does a pvegpu reset hold CT ``vmid``'s lock right now? (No lock file: no.)"""
    try:
        fd = os.open(_path(lock_dir, vmid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False
