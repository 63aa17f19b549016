"""VM GPU passthrough from Proxmox configuration: ``hostpciN`` entries and PCI resource mappings.

Reads ``/etc/pve/nodes/<node>/qemu-server/<vmid>.conf`` (top section only) and ``/etc/pve/mapping/pci.cfg``.
Manual equivalent: ``qm config <vmid> | grep hostpci`` and ``pvesh get /cluster/mapping/pci``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ID = re.compile(r"^(?:([0-9a-f]{4,}):)?([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7*]))?$")  # "*": all functions (normalised)
_HOSTPCI = re.compile(r"^hostpci(\d+):\s*(.*?)\s*$")


def normalize_bus_id(raw: str) -> str | None:
    """``41:00`` / ``0000:41:00.0`` / NVML's ``00000000:41:00.0`` → ``0000:41:00.0`` (function ``*`` when absent)."""
    m = _ID.match(raw.strip().lower())
    if not m:
        return None
    domain = (m.group(1) or "0000")[-4:]
    return f"{domain}:{m.group(2)}:{m.group(3)}.{m.group(4) if m.group(4) is not None else '*'}"


def same_device(configured: str, gpu_bus_id: str) -> bool:
    """Does a configured id (function optional = all functions) name this GPU?"""
    a, b = normalize_bus_id(configured), normalize_bus_id(gpu_bus_id)
    if a is None or b is None:
        return False
    return a == b or (a.endswith(".*") and b.rsplit(".", 1)[0] == a[:-2])


@dataclass(frozen=True)
class HostPci:
    """One ``hostpciN`` entry: raw ids (``;`` alternatives) or a mapping name, and its driver mode."""

    key: str
    ids: tuple[str, ...]
    mapping: str | None
    driver: str  # "vfio" (default: bound to vfio-pci at VM start) or "keep"
    mdev: str | None
    raw: str


def parse_hostpci(conf_text: str) -> list[HostPci]:
    """The ``hostpciN`` lines of a VM config's top section (pending and snapshot sections are not the running VM)."""
    out: list[HostPci] = []
    for line in conf_text.splitlines():
        line = line.strip()
        if line.startswith("["):
            break
        m = _HOSTPCI.match(line)
        if not m:
            continue
        opts: dict[str, str] = {}
        ids: tuple[str, ...] = ()
        for i, part in enumerate(p.strip() for p in m.group(2).split(",")):
            key, sep, value = part.partition("=")
            if not sep and i == 0:
                key, value = "host", part
            opts[key] = value
        if "host" in opts:
            ids = tuple(i for i in opts["host"].split(";") if i)
        out.append(HostPci(f"hostpci{m.group(1)}", ids, opts.get("mapping") or None, opts.get("driver", "vfio"),
                           opts.get("mdev") or None, m.group(2)))
    return out


def parse_pci_mapping(text: str, node: str) -> dict[str, tuple[str, ...]]:
    """``/etc/pve/mapping/pci.cfg`` → mapping id → this node's PCI paths (``;`` lists kept in order)."""
    out: dict[str, tuple[str, ...]] = {}
    current: str | None = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            current = line.strip()
            out.setdefault(current, ())
            continue
        key, _, value = line.strip().partition(" ")
        if key != "map" or current is None:
            continue
        props = dict(p.partition("=")[::2] for p in value.strip().split(","))
        if props.get("node") == node and props.get("path"):
            out[current] = out[current] + tuple(p for p in props["path"].split(";") if p)
    return out
