"""One ``pvegpu gpu-reset`` per GPU, and its draining mark: ``flock`` on ``<drain_dir>/gpu<minor>.lock``.

Manual equivalent: ``flock -n /run/pvegpu/draining/gpu0.lock pvegpu gpu-reset 0``. The directory is checked as the
reset locks' is (``locks.open_dir``: pvegpu's own, mode 0700). The file says ``holder=<pid>:<start ticks>``,
``since=<unix time>`` and, while starts onto the GPU must be refused, ``draining=1``. The start gate and
``pvegpu reset`` refuse while the file is locked and marked; a mark whose holder died is no mark (the kernel
released its lock with the process), so a killed gpu-reset never blocks a start.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from pvegpu.adapters.locks import _fields, _held, _identity, open_dir
from pvegpu.core.errors import BusyError, UsageError

SETTING = "gpureset.drain_dir"


def _name(minor: int) -> str:
    return f"gpu{minor}.lock"


class gpu_lock:  # noqa: N801 - used as ``with gpu_lock(dir, 0, "GPU 0"):``
    """The GPU's lock, taken at once or not at all (BusyError naming the holder); ``drain()``/``undrain()`` mark it."""

    def __init__(self, drain_dir: str, minor: int, label: str) -> None:
        self.drain_dir, self.minor, self.label = drain_dir, minor, label
        self.fd = -1
        self.fields: dict[str, str] = {}

    def __enter__(self) -> gpu_lock:
        dfd = open_dir(self.drain_dir, create=True, what="gpu-reset lock directory", setting=SETTING)
        try:
            self.fd = os.open(_name(self.minor), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=dfd)
        except OSError as exc:
            raise UsageError(f"cannot take the gpu-reset lock {os.path.join(self.drain_dir, _name(self.minor))}: {exc.strerror}",
                             f"run pvegpu as root, or set {SETTING} to a directory it may write") from None
        finally:
            os.close(dfd)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _fields(self.fd).get("holder", "").split(":")[0]
            os.close(self.fd)
            self.fd = -1
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # ENOLCK, EINTR...: said, not a traceback
                raise UsageError(f"cannot take the gpu-reset lock {os.path.join(self.drain_dir, _name(self.minor))}: "
                                 f"{exc.strerror}", f"is {SETTING} on a filesystem with locks (a local one, such as /run)?") from None
            raise BusyError(f"another pvegpu gpu-reset of {self.label} is running" + (f" (pid {holder})" if holder.isdigit() else ""),
                            "let it finish (it has its own deadlines); its report says where every guest is") from None
        self.fields = {"holder": _identity(os.getpid()) or str(os.getpid()), "since": f"{time.time():.0f}"}
        self._write()
        return self

    def _write(self) -> OSError | None:
        """The fields into the lock file; the error when they could not be written."""
        data = "".join(f"{k}={v}\n" for k, v in self.fields.items()).encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError as exc:
            return exc
        return None

    def drain(self) -> None:
        """From now on the gate refuses starts onto the GPU, and ``pvegpu reset`` of its guests. A mark that cannot be
        written (ENOSPC, EIO) is a UsageError, before anything is stopped: the gate would not see it."""
        self.fields["draining"] = "1"
        if (exc := self._write()) is not None:
            raise UsageError(f"cannot mark {self.label} draining in {os.path.join(self.drain_dir, _name(self.minor))}: "
                             f"{exc.strerror or exc}", f"is {SETTING} on a full or failing filesystem? nothing was stopped")

    def undrain(self) -> None:
        """The GPU is back: starts are judged as for any start again (the lock stays: one gpu-reset at a time)."""
        self.fields.pop("draining", None)
        self._write()

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            self.undrain()
            os.close(self.fd)  # closing releases the flock
            self.fd = -1


def draining(drain_dir: str, minor: int) -> str | None:
    """'GPU minor N is being reset by pvegpu gpu-reset (pid P since T)' while a live gpu-reset holds the GPU's lock
    and marked it draining; else None (no file, no trusted directory, no holder: its pid died). A mark that exists but
    cannot be read (EACCES, EMFILE, EIO...) is unknown, and unknown counts as a mark: the gate fails closed."""
    try:
        dfd = open_dir(drain_dir, create=False, what="gpu-reset lock directory", setting=SETTING)
    except (OSError, UsageError):  # no directory, or one gpu-reset would refuse too: no gpu-reset can hold a lock there
        return None
    try:
        fd = os.open(_name(minor), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):  # no gpu-reset of it since boot; a link gpu-reset would refuse
            return None
        return _unknown(drain_dir, minor, exc)
    finally:
        os.close(dfd)
    try:
        if not _held(fd):
            return None
        f = _fields(fd)
    finally:
        os.close(fd)
    if f.get("draining") != "1":
        return None
    pid = f.get("holder", "?").split(":")[0]
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(f.get("since", ""))))
    except (ValueError, OverflowError, OSError):
        since = "an unknown time"
    return f"GPU minor {minor} (/dev/nvidia{minor}) is being reset by pvegpu gpu-reset (pid {pid} since {since})"


def draining_any(drain_dir: str, minors: frozenset[int] | None) -> str | None:
    """The first mark among ``minors`` (None: every GPU, a container granted them all), else None."""
    if minors is None:
        try:  # the directory as ``draining`` judges it: none, or one gpu-reset would refuse too, is no mark
            dfd = open_dir(drain_dir, create=False, what="gpu-reset lock directory", setting=SETTING)
        except (OSError, UsageError):
            return None
        try:
            names = os.listdir(dfd)
        except OSError as exc:
            return _unknown(drain_dir, None, exc)
        finally:
            os.close(dfd)
        minors = frozenset(int(n[3:-5]) for n in names if n.startswith("gpu") and n.endswith(".lock") and n[3:-5].isdigit())
    return next((m for minor in sorted(minors) if (m := draining(drain_dir, minor))), None)


def _unknown(drain_dir: str, minor: int | None, exc: OSError) -> str:
    what = f"GPU minor {minor}" if minor is not None else "its GPUs"
    return (f"whether a pvegpu gpu-reset is resetting {what} is unknown: {os.path.join(drain_dir, _name(minor) if minor is not None else '')} "
            f"cannot be read ({exc.strerror or exc})")
