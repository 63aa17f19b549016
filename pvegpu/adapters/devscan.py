"""Which GPUs one process holds, proven by device number and bounded in cost.

Manual equivalents: ``ls -l /proc/<pid>/fd`` and ``stat -L -c %t:%T /proc/<pid>/fd/*`` (open device
nodes), ``cat /proc/<pid>/maps`` and ``stat -L /proc/<pid>/map_files/<start>-<end>`` (mapped ones);
together what ``fuser -v /dev/nvidia*`` reports.

Rules a tenant cannot bend:

- A holding is a *character device number* (``st_rdev``) that the DeviceTable names, never path text:
  a plain file called ``/dev/nvidia7`` or a mapping whose path contains ``" /dev/nvidia3"`` holds nothing,
  and a ``mknod`` copy or bind mount of a real node (another path, the same number) still counts.
- fds first; ``maps`` is read only when the fds show no GPU, streamed line by line, and each mapped
  file is stat'ed once per scan (cached by the device and inode the kernel writes in ``maps``).
- Every process has a budget (fds, maps lines and bytes, wall time). A process that runs over it is
  reported with ``via = {"unreadable", "budget"}`` and whatever it was already seen to hold: unknown
  for that process, never "holds nothing", and never a failure of the whole scan.
- Nothing a FUSE or NFS server answers is waited for: every fd is stat'ed with ``statx(AT_STATX_DONT_SYNC)``,
  which FUSE, NFS, CIFS and overlayfs answer from the inode the kernel already has, never asking the server (a
  server that never answers cannot hold the scan, nor leave pvegpu's threads unkillable in the kernel); pipes,
  sockets and anon inodes are answered by the kernel alone. Mapped files likewise. (An injected ``stat_of``, or
  ``os.stat`` where libc lacks ``statx``, is only handed fds whose link names a path.)
- A process whose main thread exited while other threads run has an empty ``fd`` directory and no
  ``map_files``; its threads' ``task/<tid>/fd`` are scanned, and mappings that cannot be proven make it
  ``unreadable``. ``/proc/<pid>/stat`` (kernel-written) tells such a leader, and a kernel thread, apart; it is
  read only for a process whose fd table is empty, since every process that runs a program has fds.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pvegpu.adapters.procstat import kernel_thread, parse_stat, read_small
from pvegpu.core.lxcconf import NVIDIA_MAJOR
from pvegpu.core.model import CONTROL, Holding, Via

# start-end perms offset dev inode: file-backed lines only (inode 0 is anonymous memory, heap, stack). The pattern
# rb"^([0-9a-f]+-[0-9a-f]+) \S+ \S+ ([0-9a-f]+:[0-9a-f]+) ([1-9][0-9]*) " is matched by hand (``_file_line``) on the
# fields the scan has split anyway; tests/test_scan_parsers.py runs both on every line
_HEX = b"0123456789abcdef"
_SPACE = b"\t\n\x0b\x0c\r"  # bytes ``\S``: none of these (nor the space the line is split on)


def _hex_pair(field: bytes, sep: bytes) -> bool:
    """``[0-9a-f]+<sep>[0-9a-f]+``."""
    a, found, b = field.partition(sep)
    return bool(found and a and b) and not a.translate(None, _HEX) and not b.translate(None, _HEX)


def _file_line(p: list[bytes]) -> tuple[bytes, bytes, bytes] | None:
    """(range, dev, inode) of a maps line split on its first five spaces (six parts), when the whole line matches
    the pattern above; else None."""
    rng, perms, offset, dev, inode = p[0], p[1], p[2], p[3], p[4]
    if not (inode[:1] in b"123456789" and inode[:1] and inode.isdigit()):
        return None
    if not (perms and offset) or perms.translate(None, _SPACE) != perms or offset.translate(None, _SPACE) != offset:
        return None
    return (rng, dev, inode) if _hex_pair(rng, b"-") and _hex_pair(dev, b":") else None
_CHUNK = 65536


def maps_files(lines: list[bytes], files: dict[tuple[bytes, bytes], bytes],
               known: Mapping[tuple[bytes, bytes], int | None] | None = None, skip: set[bytes] | None = None) -> None:
    """Add each file-backed mapping of ``lines`` (``/proc/<pid>/maps`` split on ``\\n``) to ``files``:
    (dev, inode) -> the first range that maps it.

    Exactly what ``findall`` of the pattern above over the text gives, faster: a split on the first five spaces
    skips anonymous lines (inode 0) and files already seen, and only a line naming a new file is checked against the
    full pattern (``_file_line``). The path (tenant text: spaces, `` (deleted)``, escaped newlines) is never parsed.
    ``known``: the scan's cache (file -> GPU minor, None for no GPU); a file it already knows is no GPU is left
    out (proving it again could only give None), one it knows is a GPU is kept.
    ``skip`` (the scan's, with ``known``): each line's text after its address range, for lines found to name no
    file or a file ``known`` says is no GPU. The same text again (the same library in the next process: only the
    addresses differ) is skipped without a split: equal texts have equal perms, offset, device and inode fields,
    whatever the path says, so the line names the same file (or none). Bounded: ``SKIP_TEXTS`` texts at most."""
    get = (known or {}).get
    if skip is None:
        for line in lines:
            p = line.split(b" ", 5)
            if len(p) == 6 and p[4] != b"0" and (key := (p[3], p[4])) not in files and get(key, 0) is not None \
                    and (m := _file_line(p)):
                files[(m[1], m[2])] = m[0]
        return
    room = len(skip) < SKIP_TEXTS
    for line in lines:
        at = line.find(b" ")
        if at >= 0 and line[at:] in skip:
            continue
        p = line.split(b" ", 5)
        if len(p) != 6:
            continue
        if p[4] == b"0" or get(key := (p[3], p[4]), 0) is None:  # anonymous, or a file known to be no GPU
            if room:
                skip.add(line[at:])
                room = len(skip) < SKIP_TEXTS
            continue
        if key not in files and (m := _file_line(p)):
            files[(m[1], m[2])] = m[0]


SKIP_TEXTS = 65_536  # line texts one scan remembers as naming no GPU (maps_files); past that, lines are split again
UNREADABLE = Via.UNREADABLE  # via: this process could not be fully read (permissions, or over budget)
BUDGET = Via.BUDGET  # via, with UNREADABLE: the per-process scan budget ran out (or the whole scan's)

_AT_FDCWD = -100
_AT_NO_AUTOMOUNT = 0x800
_AT_STATX_DONT_SYNC = 0x4000  # take the attributes the kernel has: no round trip to a FUSE/NFS/CIFS server
_STATX_TYPE_MODE = 0x3
_STATX_INO = 0x100
_STATX_SIZE = 256  # struct statx; stx_mode at 28 (u16), stx_rdev_major/minor at 128/132 (u32)


def _libc_statx() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return None
    # no argtypes: every call passes ints, a bytes path and a string buffer, which ctypes hands over as they are; the
    # checked conversion costs more per call than the syscall's own path walk (~0.35 us of ~3 us, every fd of the node)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_STATX = _libc_statx()


def stat_nosync(path: str) -> tuple[int, int]:
    """(st_mode, st_rdev) of what ``path`` names, without asking a FUSE/NFS server (``AT_STATX_DONT_SYNC``).

    Raises OSError like ``os.stat``. Without ``statx`` in libc it falls back to ``os.stat`` (which may wait
    on a server: the scan's watchdog and total budget still bound it).
    """
    if _STATX is None:
        st = os.stat(path)
        return st.st_mode, st.st_rdev
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _STATX(_AT_FDCWD, os.fsencode(path), _AT_STATX_DONT_SYNC | _AT_NO_AUTOMOUNT, _STATX_TYPE_MODE, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    raw, order = buf.raw, sys.byteorder
    mode = int.from_bytes(raw[28:30], order)
    rmaj, rmin = int.from_bytes(raw[128:132], order), int.from_bytes(raw[132:136], order)
    return mode, os.makedev(rmaj, rmin)


class StatNosync:
    """``stat_nosync`` with a buffer of its own, made once: what a scan calls for every fd and mapped file. One per
    scanning thread (each ``ProcessScan``), so a thread given up while stuck in ``statx`` never writes into the
    buffer of the scan that goes on."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(_STATX_SIZE)

    def named(self, path: str, key: tuple[bytes, bytes]) -> tuple[int, int, bool]:
        """(st_mode, st_rdev) of ``path``, and whether it is the file ``key`` names (``maps``' device and inode
        fields, b"fd:01", b"1234"): a range mapped again between reading ``maps`` and this stat is another file."""
        if _STATX is None:
            st = os.stat(path)
            return st.st_mode, st.st_rdev, _is_key(key, os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        buf = self._buf
        if _STATX(_AT_FDCWD, os.fsencode(path), _AT_STATX_DONT_SYNC | _AT_NO_AUTOMOUNT, _STATX_TYPE_MODE | _STATX_INO, buf) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        rmaj, rmin = _RDEV.unpack_from(buf, 128)
        dmaj, dmin = _RDEV.unpack_from(buf, 136)
        same = bool(_MASK.unpack_from(buf, 0)[0] & _STATX_INO) and _is_key(key, dmaj, dmin, _INO.unpack_from(buf, 32)[0])
        return _MODE.unpack_from(buf, 28)[0], os.makedev(rmaj, rmin), same

    def __call__(self, path: str | bytes) -> tuple[int, int]:
        if _STATX is None:
            return stat_nosync(os.fsdecode(path))
        buf = self._buf
        if _STATX(_AT_FDCWD, path if isinstance(path, bytes) else os.fsencode(path), _AT_STATX_DONT_SYNC | _AT_NO_AUTOMOUNT,
                  _STATX_TYPE_MODE, buf) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        rmaj, rmin = _RDEV.unpack_from(buf, 128)
        return _MODE.unpack_from(buf, 28)[0], os.makedev(rmaj, rmin)


def _is_key(key: tuple[bytes, bytes], major: int, minor: int, ino: int) -> bool:
    """Is (major, minor, ino) the file of a ``maps`` key (``%02x:%02x`` device, decimal inode)?"""
    dev, _, mn = key[0].partition(b":")
    try:
        return (int(dev, 16), int(mn, 16), int(key[1])) == (major, minor, ino)
    except ValueError:
        return False


_MASK, _INO = struct.Struct("=I"), struct.Struct("=Q")  # stx_mask (u32 at 0: was the inode asked for given), stx_ino (u64 at 32)
_FS_ENCODING = (sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())  # what os.fsencode encodes with
_MODE, _RDEV = struct.Struct("=H"), struct.Struct("=II")  # stx_mode (u16 at 28), stx_rdev_major/minor (u32 at 128/132)
_S_IFMT, _S_IFCHR = stat.S_IFMT(0o177777), stat.S_IFCHR


def control_majors(proc: str = "/proc") -> frozenset[int]:
    """Dynamic majors of nvidia-uvm and nvidia-caps (``grep nvidia /proc/devices``)."""
    try:
        with open(f"{proc}/devices", encoding="utf-8") as f:
            return frozenset(int(p[0]) for line in f if len(p := line.split()) == 2 and p[0].isdigit()
                             and p[1].startswith(("nvidia-uvm", "nvidia-caps")))
    except OSError:
        return frozenset()


class DeviceTable:
    """Which character device numbers stand for which GPU minor.

    On a node: major 195 minors 0-253 are GPUs; 195:254 (modeset), 195:255 (nvidiactl) and the dynamic
    majors of nvidia-uvm and nvidia-caps are CONTROL nodes (no particular GPU). Tests and the simulated
    node pass their own stand-in numbers, which is also what PVE's ``devN`` mknod copies are: another
    path and inode, the same device number.
    """

    def __init__(self, gpus: Mapping[tuple[int, int], int] | None = None, control: frozenset[int] | None = None,
                 proc: str = "/proc") -> None:
        self._explicit = dict(gpus) if gpus is not None else None
        self._control = control if control is not None else (control_majors(proc) if gpus is None else frozenset())

    def gpu_minor(self, rdev: int) -> int | None:
        """The GPU minor a device number stands for, CONTROL for the shared control nodes, else None."""
        return self.gpu_numbers(os.major(rdev), os.minor(rdev))

    def gpu_numbers(self, major: int, minor: int) -> int | None:
        """``gpu_minor`` of the device number (major, minor)."""
        if self._explicit is not None:
            return self._explicit.get((major, minor))
        if major == NVIDIA_MAJOR:
            return minor if minor < 254 else CONTROL
        return CONTROL if major in self._control else None

    def of_stat(self, st: os.stat_result) -> int | None:
        """The GPU minor (or CONTROL) of a stat result, None unless it is a character device in the table."""
        return self.of_mode(st.st_mode, st.st_rdev)

    def of_mode(self, mode: int, rdev: int) -> int | None:
        """The GPU minor (or CONTROL) of (st_mode, st_rdev), None unless it is a character device in the table."""
        return self.gpu_minor(rdev) if stat.S_ISCHR(mode) else None


@dataclass(frozen=True)
class ScanBudget:
    """What one process may cost the scan. Real CUDA jobs stay far below; a hostile tenant does not."""

    fds: int = 32_768  # open fds stat'ed
    map_lines: int = 100_000  # lines of /proc/<pid>/maps read
    map_bytes: int = 16 * 1024 * 1024  # bytes of /proc/<pid>/maps read (long paths)
    seconds: float = 0.25  # wall time for the whole process
    total: float = 20.0  # wall time for one whole scan (every process): past it, the rest is unknown


_NOTHING: tuple[int, frozenset[int]] = (-1, frozenset())


def _kthread(raw: bytes | None) -> bool:
    """Is this ``/proc/<pid>/stat`` text a kernel thread's (a child of kthreadd, pid 2, or kthreadd itself, with the
    kernel's own ``PF_KTHREAD``)?"""
    st = parse_stat(raw) if raw is not None else None
    return st is not None and st.ppid in (0, 2) and kernel_thread(raw)


class _OverBudget(Exception):
    pass


class ProcessScan:
    """Scan of processes, each against the budget; ``cache`` (mapped file -> GPU minor) is shared by one whole scan."""

    def __init__(self, devices: DeviceTable, budget: ScanBudget, cache: dict[tuple[bytes, bytes], int | None],
                 clock: Callable[[], float] = time.monotonic, stat_of: Callable[[str], tuple[int, int]] = stat_nosync) -> None:
        self.devices = devices
        self._use_stat(StatNosync() if stat_of is stat_nosync else stat_of)
        self.budget = budget
        self.cache = cache
        self._now = clock
        self._deadline = 0.0
        self._fds = 0
        # what every process's scan reads, looked up once (the loops below run for every process and fd of the node)
        self._seconds, self._fd_limit = budget.seconds, budget.fds
        self._map_lines, self._map_bytes = budget.map_lines, budget.map_bytes
        self._skip: set[bytes] = set()  # maps lines known to name no GPU (maps_files), for this scan as its cache
        self.proven: tuple[int, frozenset[int]] = _NOTHING  # (pid, minors its fds proved) while its maps are read

    def _use_stat(self, stat_of: Callable[[str], tuple[int, int]]) -> None:
        """Stat fds and mapped files with ``stat_of``: the default (``StatNosync``) is inlined as bytes paths and
        ``statx`` into its buffer; any other is handed text paths."""
        self._stat = stat_of
        self._raw = isinstance(stat_of, StatNosync)
        self._statx = _STATX if self._raw else None
        self._buf: Any = getattr(stat_of, "_buf", None)

    def run(self, proc: str, pid: int, leader_zombie: bool | None = None, deep: bool = False) -> Holding | None:
        """The process's holding, None when it holds no GPU (or is gone); ``deep`` reads maps even after a GPU fd.

        ``leader_zombie`` None: told here, from ``/proc/<pid>/stat``, which is read only when the fd table is empty
        (every process that runs a program has fds; a kernel thread, a zombie and a leader whose threads live on have
        none): a kernel thread holds nothing, and a leader that exited while its threads run is scanned through them."""
        minors: set[int] = set()
        via: set[str] = set()
        mapped: set[int] | None = None
        self._deadline = self._now() + self._seconds
        self._fds = 0
        self.proven = _NOTHING
        try:
            fd_dirs = self._fd_dirs(proc, pid, bool(leader_zombie))
            if fd_dirs is None:
                return None
            try:
                for d in fd_dirs:
                    if self._scan_fds(d, minors):
                        via.add(Via.FD)
            except PermissionError:  # a user's scan: a kernel thread's fds are root's to read, and it holds nothing
                if leader_zombie is None and _kthread(read_small(f"{proc}/{pid}/stat")):
                    return None
                raise
            if leader_zombie is None and not self._fds:
                raw = read_small(f"{proc}/{pid}/stat")
                st = parse_stat(raw) if raw is not None else None
                # a kernel thread (a child of kthreadd, pid 2, or kthreadd itself) has no mm and no files: holds nothing
                if _kthread(raw):
                    return None
                if st is not None and st.state == "Z" and st.threads > 1:
                    return self.run(proc, pid, True, deep)
            if deep or not minors or max(minors) < 0:  # no GPU (CONTROL is -1) by fd yet
                if minors:  # what the fds proved, for a watcher that gives this process up while its maps are read
                    self.proven = (pid, frozenset(minors))
                mapped = set()
                unproven = self._scan_maps(proc, pid, bool(leader_zombie), mapped, via)
                minors |= mapped
                if unproven:
                    via.add(UNREADABLE)
        except (ProcessLookupError, FileNotFoundError):  # exited mid-scan (ESRCH on a read of maps)
            pass
        except OSError:  # EACCES, EIO...: what cannot be read is unknown, never "holds nothing"
            via.add(UNREADABLE)
        except _OverBudget:
            via.update((UNREADABLE, BUDGET))
        if not minors and UNREADABLE not in via:
            return None
        # which GPUs it maps is known only from a whole read of its maps: a cut-short one is unknown per GPU, never "maps none"
        per_gpu = None if mapped is None or UNREADABLE in via else frozenset(mapped)
        return Holding(pid, frozenset(minors), frozenset(via), per_gpu)

    def _check(self) -> None:
        if self._now() > self._deadline:
            raise _OverBudget

    def _fd_dirs(self, proc: str, pid: int, leader_zombie: bool) -> list[str] | None:
        base = f"{proc}/{pid}"
        if not leader_zombie:  # a process gone by now: its fd directory and maps are not found, it holds nothing
            return [f"{base}/fd"]
        try:  # the leader's fd table left with it; every live thread may have its own
            return [f"{base}/task/{tid}/fd" for tid in os.listdir(f"{base}/task") if tid.isdigit()]
        except FileNotFoundError:
            return None

    def _scan_fds(self, fd_dir: str, minors: set[int]) -> bool:
        found = False
        raw = self._raw
        try:
            entries = os.scandir(fd_dir.encode(*_FS_ENCODING) if raw else fd_dir)  # os.fsencode, without its call
        except (FileNotFoundError, NotADirectoryError):
            return False
        # the default stat, inlined: statx into the scan's own buffer, the mode's type checked before the device
        statx, buf, numbers = self._statx, self._buf, self.devices.gpu_numbers
        mode_of, rdev_of, flags = _MODE.unpack_from, _RDEV.unpack_from, _AT_STATX_DONT_SYNC | _AT_NO_AUTOMOUNT
        count, limit = self._fds, self._fd_limit
        if statx is None:
            of_mode, stat_of, readlink, slash = self.devices.of_mode, self._stat, os.readlink, "/"
        with entries:
            for entry in entries:
                count += 1
                if count > limit:
                    raise _OverBudget
                if count % 256 == 0:
                    self._check()
                try:
                    path: Any = entry.path
                    if statx is not None:  # every fd, pipes and sockets too: statx(DONT_SYNC) asks no server, and one
                        # call per fd costs less than a readlink to pick the paths first (fuser stats every fd too)
                        if statx(_AT_FDCWD, path, flags, _STATX_TYPE_MODE, buf) != 0 or mode_of(buf, 28)[0] & _S_IFMT != _S_IFCHR:
                            continue  # gone, unreadable (as os.stat's OSError), or no character device
                        m = numbers(*rdev_of(buf, 128))
                    elif not readlink(path).startswith(slash):  # an injected stat (or os.stat): paths only, as always
                        continue  # pipe:[..], socket:[..], anon_inode:..: never device nodes
                    else:
                        m = of_mode(*stat_of(path))
                except OSError:
                    continue
                if m is not None:
                    minors.add(m)
                    found = True
        self._fds = count
        return found

    def _scan_maps(self, proc: str, pid: int, leader_zombie: bool, minors: set[int], via: set[str]) -> bool:
        """Mapped GPU device nodes, by device number; True when some mapping could not be proven either way.

        Streamed in chunks; each distinct mapped file (device and inode, as the kernel writes them in the
        line) is stat'ed through ``map_files`` once per scan, whatever its path text says.
        """
        maps = f"{proc}/{pid}/maps"
        if leader_zombie:
            tids = [t for t in os.listdir(f"{proc}/{pid}/task") if t.isdigit() and t != str(pid)]
            if not tids:
                return False
            maps = f"{proc}/{pid}/task/{tids[0]}/maps"
        try:
            fd = os.open(maps, os.O_RDONLY | os.O_CLOEXEC)  # streamed, never read whole
        except FileNotFoundError:
            return False
        files: dict[tuple[bytes, bytes], bytes] = {}  # (dev, inode) -> one range that maps it
        lines = size = 0
        rest = b""
        try:
            while chunk := os.read(fd, _CHUNK):
                size += len(chunk)
                lines += chunk.count(b"\n")
                if lines > self._map_lines or size > self._map_bytes or self._now() > self._deadline:
                    raise _OverBudget
                whole = (rest + chunk).split(b"\n")
                rest = whole.pop()  # a line not ended yet: completed by the next chunk (or ignored at the end)
                maps_files(whole, files, self.cache, self._skip)
        finally:
            os.close(fd)
        return self._prove(proc, pid, leader_zombie, files, minors, via) if files else False  # nothing left to prove

    def _prove(self, proc: str, pid: int, leader_zombie: bool, files: dict[tuple[bytes, bytes], bytes],
               minors: set[int], via: set[str]) -> bool:
        unproven = False
        for n, (key, rng) in enumerate(files.items()):
            if n % 256 == 255:
                self._check()
            if key in self.cache:
                m = self.cache[key]
            else:
                try:
                    path = f"{proc}/{pid}/map_files/{rng.decode('ascii')}"
                    if self._raw:  # the file stat'ed must be the (device, inode) the line named to stand for it
                        mode, rdev, same = self._stat.named(path, key)  # type: ignore[attr-defined]
                    else:
                        (mode, rdev), same = self._stat(path), True  # an injected stat: no inode to check (tests)
                except (FileNotFoundError, ProcessLookupError):
                    if not leader_zombie:
                        continue  # unmapped since, or the process is gone
                    unproven = True  # a dead leader has no map_files (ESRCH): the mapping cannot be proven
                    continue
                except PermissionError:
                    unproven = True
                    continue
                m = self.devices.of_mode(mode, rdev)
                if same:  # else the range was mapped again since maps was read: true of this process now, not of the key
                    self.cache[key] = m
            if m is not None:
                minors.add(m)
                via.add(Via.MAPS)
        return unproven
