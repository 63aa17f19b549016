"""The node_exporter textfile, written into a directory another user may own.

On Debian the Prometheus service user owns ``/var/lib/prometheus`` (the textfile directory's parent), so it can
swap the directory for a symlink, put a FIFO or a symlink to ``/dev/zero`` where ``pvegpu.prom`` was, or mount a
FUSE file system there. Root must then neither hang, nor read without limit, nor write anywhere else:

- the directory is opened once, ``O_PATH|O_DIRECTORY|O_NOFOLLOW`` (no ``open`` call reaches a file system
  server), and checked: a local file system (from the fd's mount in ``/proc/self/mountinfo``, never ``statfs``),
  owned by root or the exporter's user, not writable by group or others;
- everything after is relative to that fd: the previous file (for the last-success timestamps) is opened
  ``O_NOFOLLOW|O_NONBLOCK`` and read only if ``fstat`` says a regular file of at most 4 MiB; the new one is a
  temp file created ``O_EXCL|O_NOFOLLOW`` and renamed over the old name (a rename replaces a link, never follows it).

Manual equivalent: ``stat -c '%U %a' DIR``, then ``mv -T tmp DIR/pvegpu.prom``.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Collection, Mapping
from typing import Any

from pvegpu.adapters.safefile import read_regular, write_atomic
from pvegpu.audit.prom import parse_last_success, render
from pvegpu.core.errors import UsageError

EXPORTER_USERS = ("prometheus", "node-exporter", "node_exporter")  # Debian/Ubuntu's, and upstream's usual names
MAX_PREVIOUS = 4 * 1024 * 1024  # bytes of the previous textfile read back (it is a few KiB)
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "f2fs", "jfs", "reiserfs", "bcachefs", "ramfs", "overlay"})
HINT = "node_exporter's --collector.textfile.directory: owned by root or the exporter's user, mode 0755 or tighter, on a local disk"


def exporter_uids() -> frozenset[int]:
    """uids of the usual node_exporter service users present on this node."""
    out = set()
    for name in EXPORTER_USERS:
        try:
            out.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            continue
    return frozenset(out)


def mount_fstype(fd: int, proc: str = "/proc") -> str | None:
    """The file system type of the mount ``fd`` is on, from ``fdinfo`` + ``mountinfo`` (kernel text, no call into the fs)."""
    try:
        with open(f"{proc}/self/fdinfo/{fd}", "rb") as f:
            info = f.read(65536)
        mnt = next((ln.split(b":", 1)[1].strip() for ln in info.split(b"\n") if ln.startswith(b"mnt_id:")), None)
        if mnt is None:
            return None
        with open(f"{proc}/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split(b" ")
                if fields[0] == mnt and b"-" in fields:
                    return fields[fields.index(b"-") + 1].decode("ascii", "replace")
    except (OSError, IndexError):
        return None
    return None


def open_dir(path: str, owners: Collection[int]) -> int:
    """An ``O_PATH`` fd on the textfile directory, or UsageError when it is not a safe place to write."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"--prometheus: cannot open directory {path}: {exc.strerror or exc} (a symlink is not followed)", HINT) from None
    try:
        fstype = mount_fstype(fd)
        if fstype not in LOCAL_FS:
            raise UsageError(f"--prometheus: {path} is on a {fstype or 'unknown'} file system, not a local disk", HINT)
        st = os.fstat(fd)
        if st.st_uid not in (0, os.geteuid()) and st.st_uid not in owners:  # root, pvegpu's own user, the exporter's
            raise UsageError(f"--prometheus: {path} is owned by uid {st.st_uid}, neither root nor the exporter's user", HINT)
        if st.st_mode & 0o022:
            raise UsageError(f"--prometheus: {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})", HINT)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_previous(dirfd: int, name: str) -> str:
    """The previous textfile's text, or "" when it is absent or not a regular file of sane size (never blocks, never follows)."""
    data = read_regular(name, dirfd, MAX_PREVIOUS)
    return "" if data is None else data.decode("utf-8", "replace")


def write_at(dirfd: int, name: str, data: bytes) -> None:
    """``data`` as ``name`` in the directory: a new temp file (``O_EXCL|O_NOFOLLOW``), then renamed over the old name."""
    write_atomic(name, data, mode=0o644, dir_fd=dirfd, fsync=False)


def write_textfile(path: str, doc: Mapping[str, Any], owners: Collection[int] | None = None) -> None:
    """``pvegpu audit --prometheus PATH``: the audit as a textfile, written as described above."""
    if not path.endswith(".prom"):
        raise UsageError(f"--prometheus {path}: node_exporter reads only files ending in .prom", "e.g. /var/lib/prometheus/node-exporter/pvegpu.prom")
    directory, name = os.path.split(os.path.abspath(path))
    dirfd = open_dir(directory, exporter_uids() if owners is None else owners)
    try:
        data = render(doc, parse_last_success(read_previous(dirfd, name)))
        write_at(dirfd, name, data)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}",
                         "the directory must exist and be writable (node_exporter's --collector.textfile.directory)") from None
    finally:
        os.close(dirfd)
