"""One reader of ``/proc/<pid>/stat``, shared by the host adapter and the simulated node.

Manual equivalent: ``cat /proc/<pid>/stat`` (proc(5)). The comm field is tenant text: it may hold
spaces, ``)``, newlines and any other byte, so the fields are taken after the *last* ``)``.
An adapter (the core never reads ``/proc``); a leaf with no pvegpu imports.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Stat(NamedTuple):
    """The fields pvegpu uses; ``comm`` is raw (unescaped) bytes: escape before showing it."""

    comm: bytes
    state: str  # R S D Z T t X I ...
    ppid: int  # field 4
    pgid: int  # field 5 (process group id)
    sid: int  # field 6 (session id)
    threads: int  # field 20 (num_threads)
    start_ticks: int  # field 22 (starttime, clock ticks after boot)


def parse_stat(data: bytes | str) -> Stat | None:
    """The fields of one ``/proc/<pid>/stat`` text, or None when it is not one."""
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    lp, rp = raw.find(b"("), raw.rfind(b")")
    if lp < 0 or rp < lp:
        return None
    fields = raw[rp + 1 :].split()
    if len(fields) < 20:
        return None
    try:
        return Stat(raw[lp + 1 : rp], fields[0].decode("ascii"), int(fields[1]), int(fields[2]),
                    int(fields[3]), int(fields[17]), int(fields[19]))
    except (ValueError, UnicodeDecodeError):
        return None


def read_stat(pid: int | str, proc: str = "/proc") -> Stat | None:
    """``cat /proc/<pid>/stat`` parsed; None when the process (or the file) is gone."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            return parse_stat(f.read())
    except OSError:
        return None


PF_KTHREAD = 0x00200000  # stat field 9 (flags): a kernel thread; the kernel sets it, no process can


def read_small(path: str) -> bytes | None:
    """One read of up to 4 KiB (a stat line), None when it cannot be read: ``read_stat``'s text without a file object."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def kernel_thread(stat_text: bytes | None) -> bool:
    """Is ``/proc/<pid>/stat`` that of a kernel thread (``PF_KTHREAD`` in field 9, flags)? The kernel sets the flag;
    a kernel thread has no user memory (empty ``maps``) and no fd table of a process, so it holds no GPU."""
    if not stat_text:
        return False
    fields = stat_text[stat_text.rfind(b")") + 1 :].split()
    try:
        return len(fields) > 6 and int(fields[6]) & PF_KTHREAD != 0
    except ValueError:
        return False
