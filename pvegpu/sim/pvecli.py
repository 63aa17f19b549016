"""The simulated node's ``pct set`` and ``pvesm set``, for ``pvegpu --simulate DIR hook install | uninstall``.

``hook install`` changes a node through PVE's command line (``install.Runner``: argv in, exit code and output
out). On a simulated node these edit the node's own files instead: a container's config in ``DIR/etc-pve``,
the storage definitions in ``DIR/etc-pve/storage.cfg``. Only the three forms ``install`` uses are known; any
other command is refused (exit 1), never run on this machine.
"""

from __future__ import annotations

import os
import re

from pvegpu.sim.state import SimState


class SimPveCli:
    """``install.Runner`` for a simulated node: ``pct set VMID --hookscript V | --delete hookscript``, ``pvesm set S --content C``."""

    def __init__(self, root: str, node: str) -> None:
        self.state = SimState(root)
        self.node = node

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        if len(argv) == 5 and argv[:2] == ["pct", "set"] and argv[2].isdigit():
            if argv[3:] == ["--delete", "hookscript"]:
                return self._hookscript(int(argv[2]), None)
            if argv[3] == "--hookscript":
                return self._hookscript(int(argv[2]), argv[4])
        if len(argv) == 5 and argv[:2] == ["pvesm", "set"] and argv[3] == "--content":
            return self._content(argv[2], argv[4])
        return 1, f"{argv[0] if argv else '?'}: not simulated on a simulated node: {' '.join(argv)}"

    def _hookscript(self, vmid: int, volid: str | None) -> tuple[int, str]:
        rel = f"etc-pve/nodes/{self.node}/lxc/{vmid}.conf"
        path = os.path.join(self.state.root, rel)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return 2, f"Configuration file 'nodes/{self.node}/lxc/{vmid}.conf' does not exist"
        top, sep, rest = text.partition("\n[")  # pct set changes the current config, never a snapshot section
        lines = [line for line in top.splitlines() if not re.match(r"^hookscript:", line)]
        if volid is not None:
            lines.append(f"hookscript: {volid}")
        self.state.write(rel, ("\n".join(lines) + "\n" + ("\n[" + rest if sep else "")).encode())
        return 0, ""

    def _content(self, storage: str, content: str) -> tuple[int, str]:
        path = os.path.join(self.state.etc_pve, "storage.cfg")
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            return 2, "storage.cfg: not found"
        out, inside, done = [], False, False
        for line in lines:
            if m := re.match(r"^(\w+):\s*(\S+)\s*$", line):
                if inside and not done:
                    out.append(f"\tcontent {content}")
                    done = True
                inside = m.group(2) == storage
            elif inside and re.match(r"^\s+content\s", line):
                line, done = f"\tcontent {content}", True
            out.append(line)
        if inside and not done:
            out.append(f"\tcontent {content}")
            done = True
        if not done:
            return 255, f"storage '{storage}' does not exist"
        self.state.write("etc-pve/storage.cfg", ("\n".join(out) + "\n").encode())
        return 0, ""

