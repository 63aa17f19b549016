"""The on-disk state of a simulated node (shared by every process that looks at it).

Every write goes through directory descriptors: the node's directory is opened once per write (or held, while
``build`` lays the node out: ``SimState(root, dir_fd=...)``), each directory below it is opened relative to its
parent without following a symbolic link (``O_NOFOLLOW``), and a file is written as a new temp file
(``O_CREAT|O_EXCL|O_NOFOLLOW``) renamed over its name: a link planted anywhere in the node is refused or replaced,
never followed. Every mode is explicit (directories 0700, files 0600, the guard 0755): the caller's umask
(0002 for a user on Debian trixie) decides nothing.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any

from pvegpu.adapters.safefile import read_regular, write_atomic
from pvegpu.core.contract import dumps
from pvegpu.core.safetext import escape

DIR_MODE = 0o700  # a node's directories: only its owner enters them
FILE_MODE = 0o600  # its files: only its owner reads them
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_STATE = 16 * 1024 * 1024  # a state file is a few KiB of JSON (a task's log at most); anything this big is not one


def read_json(path: str, default: Any = None) -> Any:
    """The JSON in the regular file ``path`` (not through a symlink at its last component), else ``default``."""
    data = read_regular(path, limit=MAX_STATE)
    if data is None:
        return default
    try:
        return json.loads(data)
    except ValueError:
        return default


def read_dir(path: str) -> list[Any]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    out = []
    for n in names:
        if n.endswith(".json") and not n.startswith("."):
            d = read_json(os.path.join(path, n))
            if d is not None:
                out.append(d)
    return out


def open_subdir(dir_fd: int, rel: str, *, create: bool) -> int:
    """A new descriptor of the directory ``rel`` below ``dir_fd``, each component opened without following a
    link; with ``create``, a missing one is made (mode ``DIR_MODE``, set with fchmod: the umask takes nothing)."""
    fd = os.dup(dir_fd)
    try:
        for name in (p for p in rel.split("/") if p):
            if name in (".", ".."):
                raise ValueError(f"{rel!r}: not a path inside the node")
            made = False
            if create:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
            if made:
                os.fchmod(fd, DIR_MODE)
        return fd
    except BaseException:
        os.close(fd)
        raise


class SimState:
    """Paths inside a simulated node's directory, and the one way to write there (through directory descriptors).

    ``dir_fd``: the node's directory, already opened and checked (``build`` holds the one it made, so a rename of
    the directory while it is laid out changes nothing); else it is opened by name, without following a link."""

    def __init__(self, root: str, dir_fd: int | None = None) -> None:
        self.root = os.path.abspath(root)
        self.dir_fd = dir_fd

    @property
    def etc_pve(self) -> str:
        return os.path.join(self.root, "etc-pve")

    @property
    def snippets(self) -> str:
        return os.path.join(self.root, "snippets")

    # -- writing ---------------------------------------------------------------------------------------------

    def _open(self, rel_dir: str, *, create: bool) -> int:
        if self.dir_fd is not None:
            return open_subdir(self.dir_fd, rel_dir, create=create)
        root = os.open(self.root, DIR_FLAGS)
        try:
            return open_subdir(root, rel_dir, create=create)
        finally:
            os.close(root)

    def mkdirs(self, rel: str) -> None:
        """The directory ``rel`` (and those above it) in the node, mode 0700."""
        os.close(self._open(rel, create=True))

    def write(self, rel: str, data: bytes, mode: int = FILE_MODE) -> None:
        """``data`` as the file ``rel`` of the node, atomically (readers in other processes see old or new)."""
        head, name = os.path.split(rel)
        fd = self._open(head, create=True)
        try:
            write_atomic(name, data, mode=mode, dir_fd=fd, fsync=False)
        finally:
            os.close(fd)

    def write_json(self, rel: str, data: Any) -> None:
        self.write(rel, dumps(data).encode("utf-8"))

    def log_line(self, line: str) -> bool:
        """The simulated node's system log: ``line`` (escaped, as ``journal.log_line`` sends it) appended to
        ``journal.log`` in the node, never through a link; True when it was written."""
        try:
            fd = self._open("", create=False)
        except OSError:
            return False
        try:
            out = os.open("journal.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=fd)
            try:
                os.write(out, f"pvegpu[{os.getpid()}]: {escape(line)[:1024]}\n".encode("utf-8", "replace"))
            finally:
                os.close(out)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def symlink(self, target: str, rel: str) -> None:
        """A symbolic link ``rel`` -> ``target`` made in the node (never where a link above it points)."""
        head, name = os.path.split(rel)
        fd = self._open(head, create=True)
        try:
            os.symlink(target, name, dir_fd=fd)
        finally:
            os.close(fd)

    # -- the node's records ----------------------------------------------------------------------------------

    def gpus(self) -> list[dict[str, Any]]:
        return list(read_json(os.path.join(self.root, "gpus.json"), []))

    def set_gpus(self, gpus: list[dict[str, Any]]) -> None:
        """A GPU without ``stand_in`` gets the node's own: ``dev/nvidia<minor>`` under the root, made here."""
        self.write_json("gpus.json", [g if "stand_in" in g else g | {"stand_in": self.private_stand_in(int(g["minor"]), bool(g.get("mappable")))}
                                      for g in gpus])

    def private_stand_in(self, minor: int, mappable: bool = False) -> str:
        """A file no process outside this node opens; empty (its holders show as fd-only, like ``/dev/full``'s)
        or, ``mappable``, one page the workloads also map (as CUDA maps ``/dev/nvidiaN``)."""
        name = f"nvidia{minor}"
        dfd = self._open("dev", create=True)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dfd)
        except FileExistsError:
            pass  # made before (set_gpus again): the workloads hold that one
        else:
            try:
                os.fchmod(fd, FILE_MODE)
                os.ftruncate(fd, mmap.PAGESIZE if mappable else 0)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
        return os.path.join(self.root, "dev", name)

    def ct(self, vmid: int) -> dict[str, Any]:
        return dict(read_json(os.path.join(self.root, "cts", f"{vmid}.json"), {}))

    def set_ct(self, vmid: int, data: dict[str, Any]) -> None:
        self.write_json(f"cts/{vmid}.json", data)

    def cts(self) -> list[dict[str, Any]]:
        return read_dir(os.path.join(self.root, "cts"))

    def contexts(self) -> list[dict[str, Any]]:
        return read_dir(os.path.join(self.root, "ctx"))

    def holders(self) -> list[dict[str, Any]]:
        return read_dir(os.path.join(self.root, "holders"))

    def add_context(self, owner: int, start: int, gpu: int, nbytes: int, *, leaks: bool = False) -> None:
        self.write_json(f"ctx/{owner}.json", {"owner": owner, "start": start, "gpu": gpu, "bytes": nbytes, "leaks": leaks})

    def add_holder(self, pid: int, start: int, owner: int) -> None:
        self.write_json(f"holders/{pid}.json", {"pid": pid, "start": start, "owner": owner})

    def mark_context(self, owner: int, dead_since: float) -> None:
        """Keep when the context's last holder was seen dead (the driver's release latency runs from then)."""
        ctx = read_json(os.path.join(self.root, "ctx", f"{owner}.json"))
        if ctx is not None and ctx.get("dead_since") is None:
            self.write_json(f"ctx/{owner}.json", {**ctx, "dead_since": dead_since})

    def drop(self, kind: str, pid: int) -> bool:
        """Remove one record; True when this call removed it."""
        try:
            fd = self._open(kind, create=False)
        except FileNotFoundError:
            return False
        try:
            os.unlink(f"{pid}.json", dir_fd=fd)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return True
