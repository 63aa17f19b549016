"""Reading the settings: the file (``/etc/pvegpu/pvegpu.toml``, ``--config``, ``PVEGPU_CONFIG``), the environment,
and the snapshot of the parsed file that the start gate reads instead of parsing it again.

The rules live in ``pvegpu/core/settings.py`` (``build``); this module only gets their inputs. The file must be a
regular file of sane size (a FIFO, a device or an endless file would hang the start gate before its deadline
starts counting), owned by root or the user running pvegpu, and not writable by group or others: whoever can
write it can turn the gate off (``gate.on_unknown = "allow"``).

**Snapshot**: the parsed TOML in ``marshal`` form in ``/run/pvegpu/settings.snapshot`` for the default file (``/etc/pvegpu/pvegpu.toml``, the one the
hookscript reads) and in ``/run/pvegpu/settings-other.snapshot`` for the
latest other one (``--config``, ``PVEGPU_CONFIG``), written by a pvegpu run as root (``hook install``, the gate
itself, any command) after it parsed the file, and used instead of parsing only while the path is the same and
the file is the same one: device, inode, size,
mtime and ctime (any write, rename, chmod or chown changes the ctime; a file changed in the last 2 s gets no
snapshot, so two writes inside one timestamp tick cannot hide behind it). The ownership checks of the file are made
on every run; the snapshot is trusted only if it and its directory are root's and writable by nobody else, and
anything wrong with it (absent, stale, unreadable, not a snapshot, anything but TOML's plain types) means the TOML
is parsed, as without it. Manual equivalent: ``python3 -c 'import tomllib; print(tomllib.load(open(F, "rb")))'``.
"""

from __future__ import annotations

import marshal
import os
import stat
import time
import tomllib
from collections.abc import Mapping
from typing import Any

from pvegpu.core.errors import ConfigError
from pvegpu.core.settings import DEFAULT_PATH, Settings, build

MAX_FILE = 1024 * 1024  # a settings file is a few hundred bytes; anything this big is not one
SNAPSHOT_DIR = "/run/pvegpu"
SNAPSHOT_NAME = "settings.snapshot"  # the default file's
OTHER_NAME = "settings-other.snapshot"  # the latest other file's: one slot, so a temporary --config leaves no trail
SNAPSHOT_VERSION = 2  # 1 was JSON, in settings.json
RACY_NS = 2_000_000_000  # no snapshot of a file changed this recently: a second write in the same timestamp tick,
# of the same size, would leave mtime and ctime as they were (git's "racy" entries); the next run writes it


class _UnsafeFile(Exception):
    """The settings file may be written by someone other than root: it decides whether the gate runs at all."""


def _identity(st: os.stat_result) -> list[int]:
    """What changes whenever the file's content may have: a rewrite in place changes mtime and ctime, a rename
    over it the inode (and ctime), a chmod/chown the ctime."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _open_checked(path: str) -> tuple[int, os.stat_result]:
    """The settings file opened (non-blocking, so a FIFO cannot hang us) after its type and owner checks."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file (mode {stat.S_IFMT(st.st_mode):o})")
        if st.st_uid not in (0, os.geteuid()):
            raise _UnsafeFile(f"{path} is owned by uid {st.st_uid}, not root: whoever owns it can turn the start gate off")
        if st.st_mode & 0o022:
            raise _UnsafeFile(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                              "whoever can write it can turn the start gate off")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def _read_all(fd: int) -> bytes:
    data = os.read(fd, MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise OSError(f"larger than {MAX_FILE // 1024} KiB: not a settings file")
    return data


def _root_only(st: os.stat_result, *, directory: bool) -> bool:
    """Owned by root and writable by nobody else: only root could have written what is in it."""
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return kind and st.st_uid == 0 and not st.st_mode & 0o022


def snapshot_name(path: str) -> str:
    """The snapshot's file name in the snapshot directory: one for the default file, one for the latest other."""
    return SNAPSHOT_NAME if path == DEFAULT_PATH else OTHER_NAME


def read_snapshot(snapshot_dir: str, path: str, ident: list[int]) -> dict[str, Any] | None:
    """The parsed file's data from a trustworthy snapshot of this very file, or None (then the TOML is parsed)."""
    try:
        if not _root_only(os.stat(snapshot_dir, follow_symlinks=False), directory=True):
            return None
        fd = os.open(os.path.join(snapshot_dir, snapshot_name(path)), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not _root_only(os.fstat(fd), directory=False):
                return None
            doc = marshal.loads(_read_all(fd))
        finally:
            os.close(fd)
    except (OSError, ValueError, EOFError, TypeError):
        return None
    if not isinstance(doc, dict) or doc.get("version") != SNAPSHOT_VERSION or doc.get("path") != path or doc.get("file") != ident:
        return None
    data = doc.get("data")
    return data if isinstance(data, dict) and _toml_plain(data) else None


def _toml_plain(x: Any) -> bool:
    """Only what TOML parses to and a snapshot keeps: tables with string keys, arrays, strings, numbers, booleans."""
    if type(x) is dict:
        return all(type(k) is str and _toml_plain(v) for k, v in x.items())
    if type(x) is list:
        return all(_toml_plain(v) for v in x)
    return type(x) in (str, int, float, bool)


def write_snapshot(snapshot_dir: str, path: str, ident: list[int], data: dict[str, Any], read_ns: int) -> bool:
    """Write the snapshot (root only; atomically: a new file, then rename). False when it was not written: it is
    a cache, and the next run parses the TOML again. ``read_ns``: the wall time when the file was opened and
    stat'ed (before its content was read); the racy margin counts from it, not from now (a slow parse)."""
    if os.geteuid() != 0 or read_ns - max(ident[3], ident[4]) < RACY_NS:
        return False
    if not _toml_plain(data):  # a TOML date or time: no snapshot (the TOML is parsed each time)
        return False
    text = marshal.dumps({"version": SNAPSHOT_VERSION, "path": path, "file": list(ident), "data": data})
    try:
        try:
            os.mkdir(snapshot_dir, 0o700)
        except FileExistsError:
            pass
        if not _root_only(os.stat(snapshot_dir, follow_symlinks=False), directory=True):
            return False
        dfd = os.open(snapshot_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            name = snapshot_name(path)
            tmp = f".{name}.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError:
        return False
    return True


def _parse(raw: bytes, path: str, problems: list[str]) -> dict[str, Any] | None:
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{path}: {exc}")
    except UnicodeDecodeError as exc:
        problems.append(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})")
    return None


def read_file(path: str, problems: list[str], snapshot_dir: str | None) -> dict[str, Any]:
    """The settings file's data ({} when there is none); what is wrong with it goes to ``problems``. With
    ``snapshot_dir``, a snapshot of this very file stands in for parsing it, and a parse refreshes it (as root)."""
    read_ns = time.time_ns()  # before the fstat and the read: the racy margin counts from here
    try:
        fd, st = _open_checked(path)
    except _UnsafeFile as exc:
        raise ConfigError(f"refusing the settings file {exc}", f"chown root:root {path} && chmod 644 {path}") from None
    except FileNotFoundError:
        if path != DEFAULT_PATH:
            problems.append(f"{path}: no such file")
        return {}
    except OSError as exc:
        problems.append(f"{path}: {exc}")
        return {}
    try:
        ident = _identity(st)
        if snapshot_dir is not None:
            cached = read_snapshot(snapshot_dir, path, ident)
            if cached is not None:
                return cached
        raw = _read_all(fd)
    except OSError as exc:
        problems.append(f"{path}: {exc}")
        return {}
    finally:
        os.close(fd)
    data = _parse(raw, path, problems)
    if data is None:
        return {}
    if snapshot_dir is not None:
        write_snapshot(snapshot_dir, path, ident, data, read_ns)
    return data


def load(path: str | None = None, env: Mapping[str, str] | None = None, overrides: dict[str, Any] | None = None,
         *, snapshot_dir: str | None = "") -> Settings:
    """Settings from file (missing default file is fine), environment and overrides ("reset.grace": 3).
    ``snapshot_dir``: "" for the default (``/run/pvegpu``), None for no snapshot."""
    env = os.environ if env is None else env
    path = path or env.get("PVEGPU_CONFIG") or DEFAULT_PATH
    problems: list[str] = []
    data = read_file(path, problems, SNAPSHOT_DIR if snapshot_dir == "" else snapshot_dir)
    return build(data, env, overrides, path, problems)
