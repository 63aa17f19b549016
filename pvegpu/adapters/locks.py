"""One pvegpu reset per container at a time: ``flock`` on ``<lock_dir>/<vmid>.lock``, in a root-owned directory.

Manual equivalent: ``install -d -m 700 /run/pvegpu/locks; flock -w 10 /run/pvegpu/locks/129.lock pvegpu reset 129``.
The lock lives as long as the process holds the file open, so a killed reset never leaves a stale lock behind.

The directory is pvegpu's own: created with mode 0700 by the user running pvegpu (root on a node), and its owner
and mode checked on every use (``/run/lock`` is world-writable: a local user could pre-create a directory there,
hold its locks, or delete a running reset's lock). A directory owned by anyone else, or open to group/others, is
refused with the fix; the gate does not trust a lock in it either (no reset runs there). Files are opened
relative to the checked directory and with ``O_NOFOLLOW``.

The lock file says what its holder is doing, one ``key=value`` per line, written by the holder only:
``holder=<pid>:<start ticks>`` always; ``stop=<unix time>`` from the stop request until the container runs again
(it outlives a killed reset, so the next one can say that an earlier reset left the container stopped);
``start-until=<CLOCK_BOOTTIME s>`` while the reset starts its own container. The start gate (run by PVE's start
task, which does not inherit pvegpu's environment) finds the lock held and lets the start through the *lock*
check only while that marker is fresh and its holder is alive and still the same process; the GPU is judged
as for any start.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable

from pvegpu.core.errors import BusyError, UsageError

MAX_LOCK_FILE = 4096

MARK_MAX = 6 * 3600.0  # the longest a reset's own-start mark lasts, whatever reset.task_timeout says


def _path(lock_dir: str, vmid: int) -> str:
    return os.path.join(lock_dir, f"{vmid}.lock")


def _boottime() -> float:
    """Seconds since boot (CLOCK_BOOTTIME): the same in every process, never stepped back like the wall clock."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


def _dir_problem(st: os.stat_result, path: str, *, parent: bool) -> str | None:
    """Why ``path`` cannot hold pvegpu's locks (None: it can). The lock directory: this user's, mode 0700.
    Its parent: root's or this user's, writable by nobody else (not even sticky, as /run/lock and /tmp are)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    owners = (0, os.geteuid()) if parent else (os.geteuid(),)
    if st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}, not by uid {os.geteuid()} (pvegpu)"
    mode = stat.S_IMODE(st.st_mode)
    if parent and mode & 0o022:
        return f"{path} is writable by group or others (mode {mode:o}): another user could create pvegpu's directory first"
    if not parent and mode & 0o077:
        return f"{path} has mode {mode:o}, not 700 (open to group or others)"
    return None


def _fix(lock_dir: str, setting: str) -> str:
    return (f"remove it (`rm -r {lock_dir}`: pvegpu recreates it, mode 700) or fix it (`chown root:root {lock_dir} && "
            f"chmod 700 {lock_dir}`); keep {setting} in a root-only directory such as /run/pvegpu")


def open_dir(lock_dir: str, *, create: bool, what: str = "reset lock directory", setting: str = "reset.lock_dir") -> int:
    """An fd of ``lock_dir`` after checking it (and its parent): a directory of this user, mode 0700, not a link,
    in a parent nobody else may write. Creates it (and a missing parent) with mode 0700 when ``create``.
    Raises UsageError with the fix (FileNotFoundError when absent and not ``create``)."""
    lock_dir = os.path.abspath(lock_dir)
    parent = os.path.dirname(lock_dir)
    if create:
        for d in (parent, lock_dir):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                if not os.path.isdir(d):
                    raise UsageError(f"cannot create the {what} {d}: {exc.strerror}",
                                     f"run pvegpu as root, or set {setting} to a directory it may create") from None
    try:
        fd = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "is a symbolic link" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
        raise UsageError(f"{what} {lock_dir} {why}: refusing to use it", _fix(lock_dir, setting)) from None
    try:
        problem = _dir_problem(os.fstat(fd), lock_dir, parent=False)
        if problem is None:
            problem = _dir_problem(os.stat(parent), parent, parent=True)
    except BaseException:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise UsageError(f"{what}: {problem}: refusing to use it", _fix(lock_dir, setting))
    return fd


def _open_file(dfd: int, vmid: int, flags: int) -> int:
    """The lock file relative to the checked directory: never through a link, a regular file of this user."""
    fd = os.open(f"{vmid}.lock", flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise OSError(errno.EPERM, "not a regular file of pvegpu's user")
    return fd


def _fields(fd: int) -> dict[str, str]:
    try:
        text = os.pread(fd, MAX_LOCK_FILE, 0).decode("ascii", "replace")
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def _identity(pid: int) -> str:
    """``pid:start ticks`` of a live process ('' when gone): a recycled pid never matches."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return f"{pid}:{int(data.rsplit(b')', 1)[1].split()[19])}"
    except (OSError, ValueError, IndexError):
        return ""


class ct_lock:  # noqa: N801 - used as ``with ct_lock(dir, 129, wait):``
    """Exclusive lock of CT ``vmid``; waits up to ``wait`` seconds, then raises BusyError naming the holder.

    While held it is also the reset's ``LockPort`` (``pvegpu.core.ports``): ``stop_requested``, ``starting``,
    ``started``, ``running_again`` and ``earlier`` (what a previous holder left: a stop never undone)."""

    def __init__(self, lock_dir: str, vmid: int, wait: float, on_wait: Callable[[str], None] | None = None,
                 kind: str = "CT") -> None:
        self.lock_dir, self.vmid, self.wait, self.kind = lock_dir, vmid, wait, kind  # kind: "CT" or "VM", for the wording
        self.on_wait = on_wait  # callable(str) for progress while waiting, or None
        self.fd = -1
        self.fields: dict[str, str] = {}
        self.previous: dict[str, str] = {}

    def __enter__(self) -> ct_lock:
        path = _path(self.lock_dir, self.vmid)
        dfd = open_dir(self.lock_dir, create=True)
        try:
            self.fd = _open_file(dfd, self.vmid, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise UsageError(f"cannot take the reset lock {path}: {exc.strerror}",
                             "run pvegpu as root, or set reset.lock_dir to a directory it may write") from None
        finally:
            os.close(dfd)
        start = time.monotonic()
        deadline, said = start + self.wait, start
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            now = time.monotonic()
            if now >= deadline:
                holder = _holder(self.fd)
                os.close(self.fd)
                self.fd = -1
                raise BusyError(f"another pvegpu reset of {self.kind} {self.vmid} is running{holder}; gave up after {self.wait:g} s",
                                "let it finish (it has its own deadline), then check with `pvegpu check %d`" % self.vmid)
            if self.on_wait is not None and now - said >= 1.0:
                said = now
                self.on_wait(f"waiting for the reset lock of {self.kind} {self.vmid} held by{_holder(self.fd) or ' another reset'}: "
                             f"{now - start:.0f} s of {self.wait:g}")
            time.sleep(0.05)
        self.previous = _fields(self.fd)
        self.fields = {"holder": _identity(os.getpid()) or str(os.getpid())}
        if "stop" in self.previous:  # an earlier reset asked for a stop and never saw the CT run again: keep saying so
            self.fields["stop"] = self.previous["stop"]
        self._write()
        return self

    def _write(self) -> None:
        data = "".join(f"{k}={v}\n" for k, v in self.fields.items()).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def _set(self, key: str, value: str | None) -> None:
        if self.fd < 0:
            return
        if value is None:
            self.fields.pop(key, None)
        else:
            self.fields[key] = value
        try:
            self._write()
        except OSError:
            pass

    # -- LockPort ---------------------------------------------------------------------------------------------
    def earlier(self) -> str | None:
        """What a previous reset left: 'stop requested at <time> by pid N and never undone', or None."""
        when = self.previous.get("stop")
        if not when:
            return None
        try:
            at = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(when)))
        except (ValueError, OverflowError, OSError):
            at = "an unknown time"
        pid = self.previous.get("holder", "?").split(":")[0]
        return f"an earlier pvegpu reset of CT {self.vmid} (pid {pid}) asked for its stop at {at} and ended before it ran again"

    def stop_requested(self) -> None:
        self._set("stop", f"{time.time():.0f}")

    def running_again(self) -> None:
        self._set("stop", None)

    def starting(self, seconds: float) -> None:
        """The reset is about to start its own CT: its pre-start gate passes this lock for ``seconds`` (at most
        ``MARK_MAX``: the gate trusts no mark that reaches further, and PVE runs pre-start early in the start task)."""
        self._set("start-until", f"{_boottime() + min(MARK_MAX, max(0.0, seconds)):.3f}")

    def started(self) -> None:
        self._set("start-until", None)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            self._set("start-until", None)
            os.close(self.fd)  # closing releases the flock
            self.fd = -1


def _holder(fd: int) -> str:
    pid = _fields(fd).get("holder", "").split(":")[0]
    if not pid:  # the format before key=value lines: just the pid
        try:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            pid = ""
    return f" (pid {pid})" if pid.isdigit() else ""


def _held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    return False


def lock_state(lock_dir: str, vmid: int) -> tuple[bool, str | None]:
    """(a reset holds CT ``vmid``'s lock, the reset's own start if this is it). The second item names the reset
    (``pid N``) when the holder marked its own start of this CT, the marker is fresh and the holder is the same
    live process; then the lock does not refuse the start. No lock file, no trusted directory: no reset
    (a reset refuses to run in a directory that fails the checks)."""
    try:
        dfd = open_dir(lock_dir, create=False)
    except (OSError, UsageError):
        return False, None
    try:
        fd = _open_file(dfd, vmid, os.O_RDONLY)
    except OSError:
        return False, None
    finally:
        os.close(dfd)
    try:
        if not _held(fd):
            return False, None
        f = _fields(fd)
    finally:
        os.close(fd)
    holder, until = f.get("holder", ""), f.get("start-until", "")
    try:
        fresh = 0 <= float(until) - _boottime() <= MARK_MAX + 60
    except ValueError:
        fresh = False
    pid = holder.split(":")[0]
    if fresh and pid.isdigit() and _identity(int(pid)) == holder:
        return True, f"pid {pid}"
    return True, None


def reset_running(lock_dir: str, vmid: int) -> bool:
    """Does a pvegpu reset hold CT ``vmid``'s lock right now, other than for its own start of the CT? (No lock: no.)"""
    held, own = lock_state(lock_dir, vmid)
    return held and own is None


def own_start(lock_dir: str, vmid: int) -> str | None:
    """The reset whose own start of CT ``vmid`` is under way ('pid N'), or None."""
    return lock_state(lock_dir, vmid)[1]
