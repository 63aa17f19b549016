"""The configuration half of the audit: which guests are granted GPUs, and what would stop them starting.

Containers: ``devN`` / ``lxc.mount.entry`` / ``lxc.cgroup2.devices.allow`` grants, missing device nodes,
a hookscript whose snippet is absent. VMs: ``hostpciN`` (``mapping=`` resolved through ``mapping/pci.cfg``
for this node) and the driver bound to each device now. Manual equivalent: ``pct config <vmid>``,
``qm config <vmid> | grep hostpci``, ``ls -l /dev/nvidia*``, ``lspci -nnk -s <bus id>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pvegpu.audit.model import Flag, FlagKind, GuestRow, PassthroughRow
from pvegpu.core.errors import PvegpuError
from pvegpu.core.lxcconf import any_pair, dev_key, parse_config
from pvegpu.core.model import Guest
from pvegpu.core.ports import Host, NodeFiles, PveApi
from pvegpu.core.qemuconf import normalize_bus_id, parse_hostpci, parse_pci_mapping

NVIDIA_VENDOR = "0x10de"


@dataclass
class GuestScan:
    node: str
    guests: list[GuestRow] = field(default_factory=list)
    passthrough: list[PassthroughRow] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    hostnames: dict[int, str] = field(default_factory=dict)


def device_paths(conf: str | Mapping[str, Any]) -> list[str]:
    """``/dev/nvidia*`` paths the container needs at start: ``devN`` entries and non-optional bind mounts."""
    pairs: list[tuple[str, str]] = []
    if isinstance(conf, str):
        for line in conf.splitlines():
            line = line.strip()
            if line.startswith("["):
                break
            if (pair := any_pair(line)) is not None:
                pairs.append(pair)
    else:
        pairs = [(str(k), str(v)) for k, v in conf.items() if k != "lxc"]
        pairs += [(str(i[0]), str(i[1])) for i in conf.get("lxc") or [] if isinstance(i, (list, tuple)) and len(i) == 2]
    out: list[str] = []
    for key, value in pairs:
        if dev_key(key):
            first = value.split(",")[0]
            path = first[5:] if first.startswith("path=") else first
        elif key == "lxc.mount.entry" and value.split() and "optional" not in value:
            path = value.split()[0]
        else:
            continue
        if path.startswith("/dev/nvidia") and path not in out:
            out.append(path)
    return out


def scan_guests(pve: PveApi, host: Host | None, files: NodeFiles | None, node: str, *, cluster: bool) -> GuestScan:
    """Guests of this node (or of the cluster) with GPU grants, and the flags their configs raise."""
    scan = GuestScan(node)
    try:
        guests = pve.guests()
    except PvegpuError as exc:
        scan.flags.append(Flag(FlagKind.CONFIG_UNREADABLE, "guest list", exc.message))
        return scan
    mapping_text = files.read_pve("mapping/pci.cfg") if files is not None else None
    running = files.running_cts() if files is not None else None
    for g in guests:
        if not cluster and g.node != node:
            continue
        if g.type == "lxc":
            _container(scan, pve, host, files, g, running)
        elif g.type == "qemu" and files is not None:
            _vm(scan, files, g, mapping_text)
    return scan


def _status(g: Guest, host: Host | None, running: frozenset[int] | None) -> str:
    """running / stopped from PVE's socket test read once; else from the container's cgroup (one read per container)."""
    if running is not None:
        return "running" if g.vmid in running else "stopped"
    if host is not None:
        return "running" if host.ct_pids(g.vmid) else "stopped"
    return "unknown"


def _container(scan: GuestScan, pve: PveApi, host: Host | None, files: NodeFiles | None, g: Guest, running: frozenset[int] | None) -> None:
    gid = f"lxc/{g.vmid}"
    try:
        raw = pve.ct_config(g)
        conf = parse_config(raw)
    except PvegpuError as exc:
        scan.flags.append(Flag(FlagKind.CONFIG_UNREADABLE, gid, exc.message))
        return
    if conf.hostname:
        scan.hostnames[g.vmid] = conf.hostname
    if not (conf.gpus.minors or conf.gpus.all_gpus):
        return
    local = g.node == scan.node
    status = _status(g, host, running) if local else "unknown"
    scan.guests.append(GuestRow(g.vmid, "lxc", g.node, conf.hostname or g.name or None, status, tuple(sorted(conf.gpus.minors)),
                                conf.gpus.all_gpus, (), conf.gpus.notes))
    if conf.gpus.all_gpus:
        scan.flags.append(Flag(FlagKind.ALL_GPUS, gid, "every GPU granted by `c 195:*`, no /dev/nvidiaN named"))
    if not local or files is None:
        return
    missing = [p for p in device_paths(raw) if not files.exists(p)]
    if missing:
        scan.flags.append(Flag(FlagKind.MISSING_NODE, gid, f"configured device node(s) missing on {scan.node}: {', '.join(missing)}"))
    if conf.hookscript:
        path = files.snippet_path(conf.hookscript)
        if path is None or not files.exists(path):
            scan.flags.append(Flag(FlagKind.MISSING_HOOKSCRIPT, gid, f"hookscript {conf.hookscript} not found on {scan.node}"
                                   + (f" ({path})" if path else " (not a file storage)")))


def _vm(scan: GuestScan, files: NodeFiles, g: Guest, mapping_text: str | None) -> None:
    gid = f"qemu/{g.vmid}"
    text = files.read_pve(f"nodes/{g.node}/qemu-server/{g.vmid}.conf")
    if text is None:
        scan.flags.append(Flag(FlagKind.CONFIG_UNREADABLE, gid, f"cannot read nodes/{g.node}/qemu-server/{g.vmid}.conf"))
        return
    entries = parse_hostpci(text)
    if not entries:
        return
    mappings = parse_pci_mapping(mapping_text or "", g.node)
    local = g.node == scan.node
    bus_ids: list[str] = []
    notes: list[str] = []
    for e in entries:
        ids = e.ids
        if e.mapping is not None:
            ids = mappings.get(e.mapping, ())
            if not ids:
                notes.append(f"{e.key}: mapping {e.mapping} has no device on {g.node}")
        if e.mdev:
            notes.append(f"{e.key}: mediated device {e.mdev} (vGPU)")
        for raw in ids:
            bus = normalize_bus_id(raw) or raw
            if local:
                probe = bus.replace(".*", ".0")
                vendor = files.pci_vendor(probe)
                if vendor not in (None, NVIDIA_VENDOR):
                    continue  # a NIC or an HBA: not the audit's business
                scan.passthrough.append(PassthroughRow(g.vmid, e.key, probe, e.mapping, files.pci_driver(probe), vendor))
            bus_ids.append(bus)
    if bus_ids or notes:
        name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("name:")), None)
        scan.guests.append(GuestRow(g.vmid, "qemu", g.node, name or g.name or None, "unknown", (), False, tuple(bus_ids), tuple(notes)))
