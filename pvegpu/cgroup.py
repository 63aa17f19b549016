"""Map ``/proc/<pid>/cgroup`` text to a Proxmox guest.

PVE (lxc >= 4) puts container payload under ``/lxc/<vmid>/ns/...`` and the lxc-start monitor
under ``/lxc.monitor/<vmid>``; QEMU guests run in ``/qemu.slice/<vmid>.scope``. On cgroup v1 or
hybrid hosts there is one line per hierarchy; all of them must agree.
"""

from __future__ import annotations

import re

from .model import Place, Placement

_CT = re.compile(r"^/lxc/(\d+)(?:/|$)")
_MONITOR = re.compile(r"^/lxc\.monitor/(\d+)(?:/|$)")
_VM = re.compile(r"^/qemu\.slice/(\d+)\.scope(?:/|$)")

HOST = Placement(Place.HOST)


def placement_of_path(path: str) -> Placement:
    """Classify one cgroup path (the third field of a ``/proc/<pid>/cgroup`` line)."""
    if m := _MONITOR.match(path):
        return Placement(Place.MONITOR, int(m.group(1)))
    if m := _CT.match(path):
        return Placement(Place.CONTAINER, int(m.group(1)))
    if m := _VM.match(path):
        return Placement(Place.VM, int(m.group(1)))
    return HOST


def parse_cgroup(text: str) -> tuple[Placement, str]:
    """Placement of a process from its whole ``/proc/<pid>/cgroup`` file, and the path that decided it.

    A guest placement on any hierarchy wins over "host" (hybrid hosts leave some controllers at /),
    a monitor placement wins over a container one, and conflicting vmids make it host (untouchable).
    """
    found: list[tuple[Placement, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        place = placement_of_path(parts[2].strip())
        if place.place is not Place.HOST:
            found.append((place, parts[2].strip()))
    if not found:
        return HOST, "/"
    if any(p.place is Place.MONITOR for p, _ in found):
        return next((p, s) for p, s in found if p.place is Place.MONITOR)
    kinds = {(p.place, p.vmid) for p, _ in found}
    if len(kinds) > 1:
        return HOST, found[0][1]
    return found[0]
