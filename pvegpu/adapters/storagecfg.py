"""PVE storage definitions from ``/etc/pve/storage.cfg`` (manual equivalent: ``pvesm status``, ``cat /etc/pve/storage.cfg``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pvegpu.adapters.etcpve import read_pve
from pvegpu.core.errors import UsageError

# A storage's content types when storage.cfg has no `content` line: the plugin's default
# (pve-storage: PVE::Storage::<Type>Plugin::plugindata, second element of `content`).
DEFAULT_CONTENT = {"dir": ["images", "rootdir"], "btrfs": ["images", "rootdir"], "nfs": ["images"], "cifs": ["images"],
                   "glusterfs": ["images"], "cephfs": ["backup"]}


@dataclass
class Storage:
    name: str
    path: str
    content: list[str] | None  # None: no `content` line, the type's implicit default applies
    shared: bool = False
    type: str = "dir"

    def effective_content(self) -> list[str] | None:
        """The content types PVE uses (explicit, or the type's default); None when unknown."""
        return self.content if self.content is not None else DEFAULT_CONTENT.get(self.type)


def read_storage(pve_root: str, name: str) -> Storage:
    """A file-based storage from ``/etc/pve/storage.cfg`` (``local`` defaults to /var/lib/vz)."""
    try:
        text = read_pve(pve_root, "storage.cfg")
    except OSError:
        text = ""
    found: dict[str, Storage] = {}
    cur: Storage | None = None
    for line in text.splitlines():
        if m := re.match(r"^(\w+):\s*(\S+)\s*$", line):
            cur = found.setdefault(m.group(2), Storage(m.group(2), "", None, type=m.group(1)))
        elif cur is not None and (m := re.match(r"^\s+(\S+)\s*(.*?)\s*$", line)):
            key, value = m.groups()
            if key == "path":
                cur.path = value
            elif key == "content":
                cur.content = [c for c in value.split(",") if c]
            elif key == "shared":
                cur.shared = value == "1"
    st = found.get(name)
    if st is not None and st.path:
        return st
    if name == "local" and st is None:
        return Storage("local", "/var/lib/vz", ["iso", "vztmpl", "backup"])
    raise UsageError(f"storage '{name}' is not a file-based storage in {pve_root}/storage.cfg",
                     "hookscripts live in a directory storage with the 'snippets' content type (`pvesm status`)")
