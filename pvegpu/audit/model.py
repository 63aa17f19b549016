"""Typed rows of ``pvegpu audit`` and their versioned JSON form (``pvegpu-audit`` schema, version 1).

JSON (``pvegpu audit --json``)::

    {"schema": "pvegpu-audit", "version": 1, "generated_at": <unix s>, "attention": bool,
     "nodes": [{"node": "pve1", "ok": true, "error": null, "duration_seconds": 0.03,
                "gpus": [GPU...], "guests": [GUEST...], "passthrough": [PCI...], "flags": [FLAG...]}]}

Bytes are bytes (base units); null means unknown, never 0. New fields may be added within a version;
a field is removed or changes meaning only with a new version. ``pvegpu.core.contract`` prints it, adding
``schema_version`` and the canonical names of the one JSON contract (README "JSON contract").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pvegpu.core.driver import DriverCheck
from pvegpu.core.model import GpuHealth, Via
from pvegpu.core.units import whole_mib as _mib
from pvegpu.health import Verdict

SCHEMA = "pvegpu-audit"
SCHEMA_VERSION = 1


class FlagKind(StrEnum):
    """What the audit found; ``attention`` says whether an operator must act."""

    SHARED = "shared"
    DEAD_PID = "dead-pid"
    UNATTRIBUTED = "unattributed-memory"
    HOST_HOLDER = "host-holder"
    NVML_CLIENT = "nvml-client"
    UNKNOWN_PLACE = "unknown-placement"
    MISSING_NODE = "missing-device-node"
    MISSING_HOOKSCRIPT = "missing-hookscript"
    ALL_GPUS = "all-gpus-wildcard"
    UNREADABLE = "unreadable-gpu"
    USAGE_UNKNOWN = "usage-unknown"
    HEALTH = "health"
    CONFIG_UNREADABLE = "config-unreadable"
    NODE_UNREACHABLE = "node-unreachable"
    VM_AND_CT = "vm-and-container"
    DRIVER_MISMATCH = "driver-mismatch"
    XID = "xid"
    NEEDS_RESET = "needs-reset"
    NEEDS_REBOOT = "needs-reboot"
    GPU_LOST = "gpu-lost"

    @property
    def attention(self) -> bool:
        return self not in (FlagKind.SHARED, FlagKind.USAGE_UNKNOWN, FlagKind.NVML_CLIENT, FlagKind.XID)

    @property
    def advice(self) -> str:
        return ADVICE[self]


ADVICE: dict[FlagKind, str] = {
    FlagKind.SHARED: "several containers use this GPU; pvegpu reset of one never touches the others, but nothing limits their memory",
    FlagKind.DEAD_PID: "NVML lists a pid that is gone: a forked child keeps its context; `pvegpu reset <vmid> --dry-run` shows it",
    FlagKind.UNATTRIBUTED: "memory no live process accounts for: `fuser -v /dev/nvidia<minor>`; a GPU reset only once no process uses the GPU",
    FlagKind.HOST_HOLDER: "a host process (no guest) may own a CUDA context on this GPU (NVML lists it, or it maps the device while NVML lists a dead pid no heir explains): check it should; pvegpu never signals it",
    FlagKind.NVML_CLIENT: "a host process NVML does not list, with the device open or mapped (nvidia-persistenced, DCGM, an exporter): no context of its own, no memory; it blocks `nvidia-smi -r`",
    FlagKind.UNKNOWN_PLACE: "where this process runs could not be read (`cat /proc/<pid>/cgroup`); its memory is counted as nobody's",
    FlagKind.MISSING_NODE: ("this container will not start: create the nodes at boot, `systemctl enable pvegpu-nvidia-nodes.service` "
                            "(the .deb installs it in /usr/lib/systemd/system; a venv has it in pvegpu's data/systemd/, to copy to "
                            "/etc/systemd/system), or drop the entry"),
    FlagKind.MISSING_HOOKSCRIPT: "this container will not start on this node: `pvegpu hook install <vmid>` copies the guard here",
    FlagKind.ALL_GPUS: "`c 195:*` grants every GPU with no /dev/nvidiaN named: name the GPUs with devN entries",
    FlagKind.UNREADABLE: "NVML cannot read it: `nvidia-smi -q -i <index>`, `dmesg | grep -i xid`",
    FlagKind.USAGE_UNKNOWN: "per-process memory is not reported (MIG): leftovers cannot be measured on this GPU",
    FlagKind.HEALTH: "a reset is pending for row remapping / page retirement: reset the GPU once no process uses it",
    FlagKind.CONFIG_UNREADABLE: "the guest's config could not be read: `pct config <vmid>`",
    FlagKind.NODE_UNREACHABLE: "no live audit from this node: `ssh root@<node> pvegpu audit --json`",
    FlagKind.DRIVER_MISMATCH: ("the container's NVIDIA libraries are not the host's kernel module's version: its next CUDA start fails "
                               "with 'Driver/library version mismatch'; install the host's version in it with --no-kernel-module"),
    FlagKind.VM_AND_CT: ("a VM takes this GPU to vfio-pci at its start while containers use it through nvidia: the VM's start "
                         "blocks or the containers lose it (guard the VM: `qm set <vmid> --hookscript local:snippets/pvegpu-guard`)"),
    FlagKind.XID: "the driver logged an Xid for this GPU since its last reset (an application error needs nothing of the GPU): docs/health.md",
    FlagKind.NEEDS_RESET: "the GPU needs a reset (NVML's recovery action or a fatal Xid): the gate refuses starts onto it; `pvegpu gpu-reset <index>` (it stops its CTs and starts them again) or reboot",
    FlagKind.NEEDS_REBOOT: "the GPU needs a reboot of the node (fallen off the bus, or NVML asks for it): the gate refuses starts onto it",
    FlagKind.GPU_LOST: "NVML says the GPU is lost (fallen off the bus): only a reboot brings it back; the gate refuses starts onto it",
}


@dataclass(frozen=True)
class Flag:
    """One finding: what, about which GPU or guest, and the advice (its kind's, unless this finding has its own:
    a GPU reset is advised only for a GPU no process uses, else its users are named)."""

    kind: FlagKind
    subject: str  # "GPU 0", "lxc/129", "node pve2"
    detail: str
    advice: str | None = None  # this finding's own advice (None: ``kind.advice``)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "subject": self.subject, "detail": self.detail, "advice": self.advice or self.kind.advice,
                "attention": self.kind.attention}


@dataclass(frozen=True)
class HolderRow:
    """A live process holding a GPU: host pid, pid in its container, who runs it, where, how much, how seen."""

    pid: int
    ns_pid: int | None
    comm: str
    cmdline: str
    uid: int | None
    place: str  # "lxc", "qemu", "host", "monitor", "unknown"
    vmid: int | None
    hostname: str | None
    used_bytes: int | None  # NVML's number; None = not listed or not reported
    via: tuple[str, ...]  # "nvml", "fd", "maps"
    credited_bytes: int | None = None  # memory of a dead listed parent this process inherited (as reset credits it)
    inherited_from: int | None = None  # that dead parent's pid
    may_own_context: bool = False  # NVML lists it, or it maps the device while a dead listed pid is unexplained
    user: str | None = None  # the host's name for uid (None: it has none, or it was not asked)

    @property
    def memory_bytes(self) -> int | None:
        """What this process holds: NVML's number when listed, else the memory credited to it (0 if none)."""
        if Via.NVML in self.via:
            return self.used_bytes
        return self.credited_bytes if self.inherited_from is not None else 0

    @property
    def guest_id(self) -> str | None:
        return f"{self.place}/{self.vmid}" if self.place in ("lxc", "qemu") and self.vmid is not None else None

    @property
    def owner(self) -> str:
        if self.place == "lxc":
            return f"CT {self.vmid}"
        if self.place == "qemu":
            return f"VM {self.vmid}"
        if self.place == "monitor":
            return f"monitor {self.vmid}"
        return self.place

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "ns_pid": self.ns_pid, "comm": self.comm, "cmdline": self.cmdline, "uid": self.uid, "user": self.user,
                "place": self.place, "vmid": self.vmid, "id": self.guest_id, "hostname": self.hostname, "owner": self.owner,
                "used_bytes": self.used_bytes, "used_mib": _mib(self.used_bytes), "via": list(self.via),
                "credited_bytes": self.credited_bytes, "inherited_from": self.inherited_from,
                "may_own_context": self.may_own_context}


@dataclass(frozen=True)
class GuestRow:
    """A guest whose configuration grants GPUs (running or not)."""

    vmid: int
    type: str  # "lxc" or "qemu"
    node: str
    name: str | None
    status: str  # "running", "stopped", "unknown"
    minors: tuple[int, ...] = ()
    all_gpus: bool = False
    bus_ids: tuple[str, ...] = ()  # VMs: hostpci ids (mappings resolved for this node)
    notes: tuple[str, ...] = ()
    driver: DriverCheck | None = None  # running containers: its NVIDIA libraries against the host's kernel module

    @property
    def id(self) -> str:
        return f"{self.type}/{self.vmid}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "vmid": self.vmid, "type": self.type, "node": self.node, "name": self.name, "status": self.status,
                "minors": list(self.minors), "all_gpus": self.all_gpus, "bus_ids": list(self.bus_ids), "notes": list(self.notes),
                "driver": None if self.driver is None else self.driver.to_json()}


@dataclass(frozen=True)
class PassthroughRow:
    """A PCI device a VM's ``hostpciN`` names, with the driver the host has bound to it now."""

    vmid: int
    key: str  # hostpci0
    bus_id: str
    mapping: str | None
    driver: str | None  # "vfio-pci", "nvidia", "" (none), None (no such device / unreadable)
    vendor: str | None  # "0x10de" = NVIDIA

    @property
    def note(self) -> str:
        if self.driver == "vfio-pci":
            return f"bound to vfio-pci: passed through to VM {self.vmid}; host NVML cannot see it"
        if self.driver is None:
            return "no such PCI device on this node"
        if self.driver == "":
            return "no driver bound; bound to vfio-pci when the VM starts"
        return f"host driver {self.driver}; bound to vfio-pci when VM {self.vmid} starts (unless driver=keep)"

    def to_json(self) -> dict[str, Any]:
        return {"id": f"qemu/{self.vmid}", "vmid": self.vmid, "key": self.key, "bus_id": self.bus_id, "mapping": self.mapping,
                "driver": self.driver, "vendor": self.vendor, "note": self.note}


@dataclass
class GpuRow:
    """One GPU of the node: identity, memory, health, holders and the guests configured for it."""

    index: int
    minor: int
    uuid: str
    bus_id: str
    name: str
    total_bytes: int | None = None
    used_bytes: int | None = None
    unattributed_bytes: int | None = None  # net of the per-context allowance (the one leftover rule)
    residual_bytes: int | None = None  # used minus the live processes' (and heirs') memory, before the allowance
    allowance_bytes: int | None = None  # per-context overhead allowed for the live contexts
    contexts: int | None = None  # live CUDA contexts (listed processes, credited heirs)
    threshold_bytes: int | None = None  # unattributed above this is flagged
    health: GpuHealth = field(default_factory=GpuHealth)
    verdict: Verdict | None = None  # the health verdict (``pvegpu.health``); None: health not read
    holders: list[HolderRow] = field(default_factory=list)
    dead_pids: list[int] = field(default_factory=list)
    granted_to: list[str] = field(default_factory=list)  # guest ids, "lxc/129" / "qemu/200"
    flags: list[FlagKind] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        h = self.health
        return {"index": self.index, "minor": self.minor, "uuid": self.uuid, "bus_id": self.bus_id, "name": self.name,
                "readable": self.error is None, "error": self.error,
                "total_bytes": self.total_bytes, "used_bytes": self.used_bytes, "reserved_bytes": h.reserved_bytes,
                "unattributed_bytes": self.unattributed_bytes, "used_mib": _mib(self.used_bytes),
                "unattributed_mib": _mib(self.unattributed_bytes),
                "residual_bytes": self.residual_bytes, "context_allowance_bytes": self.allowance_bytes,
                "contexts": self.contexts, "threshold_bytes": self.threshold_bytes,
                "health": {"retired_pages_pending": h.retired_pages_pending, "remap_pending": h.remap_pending,
                           "remap_failed": h.remap_failed, "mig_enabled": h.mig_enabled, "recovery_action": h.recovery_action,
                           "ecc_volatile_uncorrected": h.ecc_volatile_uncorrected, "persistence_mode": h.persistence_mode,
                           "lost": h.lost,
                           "verdict": self.verdict.to_json() if self.verdict is not None else None},
                "driver_version": h.driver_version,
                "holders": [x.to_json() for x in self.holders], "dead_pids": list(self.dead_pids),
                "granted_to": list(self.granted_to),
                "configured_for": sorted(int(g.split("/")[1]) for g in self.granted_to if g.startswith("lxc/")),
                "flags": [f.value for f in self.flags]}


@dataclass
class NodeAudit:
    """The audit of one node."""

    node: str
    gpus: list[GpuRow] = field(default_factory=list)
    guests: list[GuestRow] = field(default_factory=list)
    passthrough: list[PassthroughRow] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    error: str | None = None  # the GPUs as a whole could not be read (NVML down) or the node not reached
    duration_seconds: float | None = None

    @property
    def attention(self) -> bool:
        return self.error is not None or any(f.kind.attention for f in self.flags)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ok": self.error is None, "error": self.error, "duration_seconds": self.duration_seconds,
                "attention": self.attention, "gpus": [g.to_json() for g in self.gpus], "guests": [g.to_json() for g in self.guests],
                "passthrough": [p.to_json() for p in self.passthrough], "flags": [f.to_json() for f in self.flags]}


def document(nodes: list[dict[str, Any]], generated_at: float) -> dict[str, Any]:
    """The versioned JSON document around node audits (already in JSON form: local or from other nodes)."""
    return {"schema": SCHEMA, "version": SCHEMA_VERSION, "generated_at": round(generated_at, 3),
            "attention": any(n.get("attention") or not n.get("ok", False) for n in nodes), "nodes": nodes}


