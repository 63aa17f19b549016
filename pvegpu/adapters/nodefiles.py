"""The node's files the audit checks: device nodes, hookscript snippets, ``/etc/pve`` text, PCI drivers in sysfs.

Manual equivalents: ``ls -l /dev/nvidia*``, ``pvesm path local:snippets/<name>``, ``cat /etc/pve/mapping/pci.cfg``,
``readlink /sys/bus/pci/devices/0000:41:00.0/driver`` (``lspci -k -s 41:00.0``),
``grep /var/lib/lxc/ /proc/net/unix`` (running containers, as ``pct status`` tests it).
"""

from __future__ import annotations

import os
import re

from ..errors import UsageError
from .storagecfg import read_storage

_LXC_SOCKET = re.compile(r"^@/var/lib/lxc/(\d+)/command$")  # the whole path column, nothing around it


class LocalNodeFiles:
    """NodeFiles on a PVE node; every root can be moved (tests, the simulated node)."""

    def __init__(self, pve_root: str = "/etc/pve", sysfs: str = "/sys", dev_map: dict[str, str] | None = None,
                 snippets_dir: str | None = None, proc: str = "/proc") -> None:
        self.pve_root = pve_root
        self.proc = proc
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
        try:
            with open(os.path.join(self.proc, "net", "unix"), encoding="utf-8", errors="replace") as f:
                paths = (line.split()[-1] for line in f.read().splitlines()[1:] if len(line.split()) >= 8)
                return frozenset(int(m.group(1)) for p in paths if (m := _LXC_SOCKET.match(p)))
        except OSError:
            return None

    def read_pve(self, relpath: str) -> str | None:
        try:
            with open(os.path.join(self.pve_root, relpath), encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError):
            return None

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
