"""The node's files the audit checks: device nodes, hookscript snippets, ``/etc/pve`` text, PCI drivers in sysfs.

Manual equivalents: ``ls -l /dev/nvidia*``, ``pvesm path local:snippets/<name>``, ``cat /etc/pve/mapping/pci.cfg``,
``readlink /sys/bus/pci/devices/0000:41:00.0/driver`` (``lspci -k -s 41:00.0``),
``grep populated /sys/fs/cgroup/lxc/*/cgroup.events`` (running containers).

"Running" is read from the container's cgroup, which only root (lxc) can create: not from the abstract socket
``@/var/lib/lxc/<vmid>/command`` that ``pct status`` tests, because any local user can bind that name first.
"""

from __future__ import annotations

import errno
import os

from pvegpu.adapters.etcpve import read_pve_or_none
from pvegpu.adapters.safefile import read_regular
from pvegpu.adapters.storagecfg import read_storage
from pvegpu.core.driver import LIB_DIRS, kernel_version, lib_versions
from pvegpu.core.errors import UsageError

CGROUP_TOPS = ("", "unified", "pids", "memory", "cpu", "systemd")  # v2 root, hybrid's unified, v1 hierarchies


class LocalNodeFiles:
    """NodeFiles on a PVE node; every root can be moved (tests, the simulated node)."""

    def __init__(self, pve_root: str = "/etc/pve", sysfs: str = "/sys", dev_map: dict[str, str] | None = None,
                 snippets_dir: str | None = None, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.pve_root = pve_root
        self.proc = proc
        self.cgroup_root = cgroup_root
        self.sysfs = sysfs
        self.dev_map = dev_map or {}  # path -> stand-in (the simulated node), else the path itself
        self.snippets_dir = snippets_dir  # every snippet lives here (the simulated node), else storage.cfg decides

    def exists(self, path: str) -> bool:
        return os.path.exists(self.dev_map.get(path, path))

    def snippet_path(self, volid: str) -> str | None:
        storage, sep, rest = volid.partition(":")
        if not sep or not rest.startswith("snippets/"):
            return None
        name = rest.split("snippets/", 1)[1]
        if self.snippets_dir is not None:
            return os.path.join(self.snippets_dir, name)
        try:
            st = read_storage(self.pve_root, storage)
        except UsageError:
            return None
        return os.path.join(st.path, "snippets", name)

    def running_cts(self) -> frozenset[int] | None:
        """Containers with a populated ``lxc/<vmid>`` cgroup (v2: ``cgroup.events``; v1: a pid in its tree); None
        when no cgroup hierarchy with an ``lxc`` directory can be read (unknown, never "all stopped")."""
        for sub in CGROUP_TOPS:
            top = os.path.join(self.cgroup_root, sub, "lxc")
            if not os.path.isdir(top):
                continue
            try:
                names = [n for n in os.listdir(top) if n.isdigit() and n.isascii()]
            except OSError:
                return None
            return frozenset(int(n) for n in names if _populated(os.path.join(top, n)))
        mounted = any(os.path.exists(os.path.join(self.cgroup_root, sub, "cgroup.procs")) for sub in CGROUP_TOPS)
        return frozenset() if mounted else None  # a cgroupfs without lxc/: no container runs

    def read_pve(self, relpath: str) -> str | None:
        return read_pve_or_none(self.pve_root, relpath)

    def _dev(self, bus_id: str) -> str:
        return os.path.join(self.sysfs, "bus", "pci", "devices", bus_id)

    def pci_driver(self, bus_id: str) -> str | None:
        if not os.path.isdir(self._dev(bus_id)):
            return None
        try:
            return os.path.basename(os.readlink(os.path.join(self._dev(bus_id), "driver")))
        except FileNotFoundError:
            return ""  # present, no driver bound
        except OSError:
            return None

    def pci_vendor(self, bus_id: str) -> str | None:
        try:
            with open(os.path.join(self._dev(bus_id), "vendor"), encoding="ascii") as f:
                return f.read().strip().lower()
        except (OSError, UnicodeDecodeError):
            return None

    def driver_version(self) -> str | None:
        """The host's NVIDIA kernel module version (``cat /proc/driver/nvidia/version``); None when unreadable."""
        data = read_regular(os.path.join(self.proc, "driver", "nvidia", "version"), limit=MAX_VERSION_FILE)
        return None if data is None else kernel_version(data.decode("utf-8", "replace"))

    def ct_root(self, vmid: int, init_pid: int) -> str:
        """The container's root as the host sees it: its init's ``/proc/<pid>/root``."""
        return os.path.join(self.proc, str(init_pid), "root")

    def ct_lib_versions(self, vmid: int, init_pid: int) -> frozenset[str] | None:
        """The NVIDIA driver versions named by library files in the container's usual lib directories (file names only,
        at most ``MAX_LIB_ENTRIES`` entries each); every directory below its root is opened without following a link, so
        a tenant's link never leads out of it. None (unknown, never "match") when its root cannot be opened, or a lib
        directory there cannot be read or has more entries than are read: versions past the cut would go unseen."""
        try:
            root = os.open(self.ct_root(vmid, init_pid), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        found: set[str] = set()
        try:
            for rel in LIB_DIRS:
                fd = _open_below(root, rel)
                if fd is None:
                    continue
                try:
                    names: list[str] = []
                    with os.scandir(fd) as it:
                        for entry in it:
                            if len(names) >= MAX_LIB_ENTRIES:
                                return None
                            names.append(entry.name)
                    found |= lib_versions(names)
                finally:
                    os.close(fd)
        except OSError:
            return None
        finally:
            os.close(root)
        return frozenset(found)


def _populated(cg: str) -> bool:
    """Whether cgroup directory ``cg`` has a process anywhere below it."""
    try:
        with open(os.path.join(cg, "cgroup.events"), encoding="utf-8") as f:
            return any(line.split() == ["populated", "1"] for line in f)
    except FileNotFoundError:  # cgroup v1: no cgroup.events
        pass
    except (OSError, UnicodeDecodeError):
        return False
    for _path, _dirs, files, dirfd in os.fwalk(cg):
        if "cgroup.procs" in files:
            try:
                fd = os.open("cgroup.procs", os.O_RDONLY, dir_fd=dirfd)
                try:
                    if os.read(fd, 64).strip():
                        return True
                finally:
                    os.close(fd)
            except OSError:
                continue
    return False

MAX_VERSION_FILE = 64 * 1024  # /proc/driver/nvidia/version is one or two lines
MAX_LIB_ENTRIES = 20_000  # a lib directory holds a few thousand files; past this it is not read further


def _open_below(root: int, rel: str) -> int | None:
    """A descriptor of the directory ``rel`` below ``root``, each component opened with O_NOFOLLOW (a link, e.g. a
    merged-/usr ``lib -> usr/lib``, is skipped: the real directory is read under its own name); None when absent;
    OSError when it is there but cannot be opened (EACCES, EIO: unknown)."""
    fd = os.dup(root)
    try:
        for name in rel.split("/"):
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = sub
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
