"""The kernel log since boot, read bounded: ``/dev/kmsg`` (or the simulated node's ``kmsg`` file, same format).

``/dev/kmsg`` opened non-blocking starts at the oldest record the ring buffer still holds; each ``read`` returns one
record, ``EAGAIN`` is the end, ``EPIPE`` says records were overwritten under the reader (the ring wrapped). A record is
``PRIO,SEQ,USEC,FLAGS;TEXT``; sequence numbers start at 0 each boot, so a first record with SEQ 0 means the whole boot is
there. Reading needs root or ``kernel.dmesg_restrict = 0`` (in an unprivileged container it fails: the reading is then
unknown with the reason, never "no Xid"). Bounded in bytes, records and time: a log not read to its end is unknown too.
Manual equivalent: ``dmesg --raw | grep -e NVRM -e 'GPU reset'``.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from pvegpu.health.kernlog import KernelEvents, Record, events, parse_record

KMSG = "/dev/kmsg"
CHUNK = 16384  # more than one record's largest size (the kernel refuses a read smaller than the record: EINVAL)


NF_LOG_ALL_NETNS = "/proc/sys/net/netfilter/nf_log_all_netns"


class KmsgLog:
    """A ``core.ports.KernelLog`` over ``path``: ``events()`` reads it whole (bounded) and keeps the GPUs' events only."""

    def __init__(self, path: str = KMSG, *, max_bytes: int = 16 * 1024 * 1024, max_records: int = 400_000, deadline: float = 1.0,
                 nf_log_all_netns: str = NF_LOG_ALL_NETNS) -> None:
        self.path, self.max_bytes, self.max_records, self.deadline = path, max_bytes, max_records, deadline
        self.nf_log_all_netns = nf_log_all_netns

    def events(self) -> KernelEvents:
        """The Xids and GPU resets since boot; ``error`` says why not (unreadable, cut short by a bound)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
        except OSError as exc:
            hint = " (as root; in a container /dev/kmsg is the host's only when kernel.dmesg_restrict allows)" if exc.errno in (errno.EPERM, errno.EACCES) else ""
            return KernelEvents(error=f"cannot read {self.path}: {exc.strerror or exc}{hint}")
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISCHR(mode) or stat.S_ISREG(mode)):
                return KernelEvents(error=f"{self.path} is neither the kernel log device nor a file")
            return self._read(fd)
        finally:
            os.close(fd)

    def _read(self, fd: int) -> KernelEvents:
        ends = time.monotonic() + self.deadline
        records: list[Record] = []
        tail, size, count, first, wrapped = b"", 0, 0, None, False
        while True:
            try:
                chunk = os.read(fd, CHUNK)
            except BlockingIOError:
                break  # the end of the log
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while read: the position moved on to the oldest record left
                    wrapped = True
                    continue
                return KernelEvents(error=f"cannot read {self.path}: {exc.strerror or exc}")
            if not chunk:
                break  # a file's end
            size += len(chunk)
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            for raw in lines:
                if raw[:1] == b" ":
                    continue  # the record's dictionary
                r = parse_record(raw.decode("utf-8", "replace"))
                if r is None:
                    continue
                count += 1
                first = r if first is None else first
                if "NVRM" in r.text or "GPU reset" in r.text:
                    records.append(r)
            if size > self.max_bytes or count > self.max_records:
                return KernelEvents(error=f"{self.path} holds more than {self.max_bytes // 1048576} MiB or {self.max_records} records: not read to its end")
            if time.monotonic() > ends:
                return KernelEvents(error=f"{self.path} could not be read within {self.deadline:g} s")
        xids, resets = events(records)
        return KernelEvents(tuple(xids), tuple(resets), None, complete=first is None or (first.seq == 0 and not wrapped),
                            first_us=None if first is None else first.at_us, forgeable=self._forgeable())

    def _forgeable(self) -> bool:
        """Whether a container's firewall may log into this log: ``net.netfilter.nf_log_all_netns = 1`` lets any network
        namespace's LOG rule write a kernel record that begins with its own prefix (``NVRM: Xid ...``). Absent (no
        netfilter logging loaded) is no; unreadable or any other value is yes."""
        try:
            with open(self.nf_log_all_netns, encoding="ascii", errors="replace") as f:
                return f.read(16).strip() != "0"
        except FileNotFoundError:
            return False
        except OSError:
            return True

    def write(self, text: str) -> None:
        """Add ``text`` to the log as one record (``echo TEXT > /dev/kmsg``; the simulated node's file gets a whole record
        line, its sequence number the next). For ``health.reset_record``: the reset that ends a GPU's Xids. Raises OSError."""
        clean = "".join(c if c.isprintable() else " " for c in text)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NOFOLLOW", 0))
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode):
                os.write(fd, f"<6>{clean}\n".encode())
                return
            seq = _next_seq(self.path)  # facility user, as the kernel marks every write to /dev/kmsg
            os.write(fd, f"14,{seq},{time.monotonic_ns() // 1000},-;{clean}\n".encode())
        finally:
            os.close(fd)


def _next_seq(path: str) -> int:
    """The sequence number after the last record of the simulated node's log file."""
    last = -1
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if (r := parse_record(line)) is not None:
                last = r.seq
    return last + 1
