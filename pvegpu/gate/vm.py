"""The start gate for a VM: may VM ``vmid`` take its passed-through GPUs now?

PVE unbinds each ``hostpciN`` device from the host's driver and binds it to ``vfio-pci`` *after* the
hookscript's pre-start. If a host or container process still uses that GPU through the nvidia driver (a GPU
granted to a VM and, often through ``c 195:*``, to containers), the unbind blocks or the start fails half-way
and the container's workload loses its GPU under it. So pre-start refuses while any process holds such a GPU,
naming the holders and how to free them; it allows a GPU that is idle, bound to ``vfio-pci`` already (host NVML
cannot see it, nobody on the host can use it), or has no driver bound. ``driver=keep`` and mediated devices
(vGPU) stay on the host driver: they are not taken, and not judged.

Devices come from the VM config's top section (``hostpciN``; ``mapping=`` resolved through
``/etc/pve/mapping/pci.cfg`` for this node) and are matched to NVML GPUs by PCI bus address. Manual
equivalent: ``qm config VMID | grep hostpci``, ``lspci -k -s 41:00.0``, ``fuser -v /dev/nvidiaN``,
``nvidia-smi --query-compute-apps=pid,used_memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pvegpu.core.errors import GpuQueryError, NotFoundError
from pvegpu.core.holders import GpuFacts, inspect_gpus
from pvegpu.core.leftover import gpu_reset_advice, leftover, place_name
from pvegpu.core.model import GpuInfo, GpuSample, Guest, Holder, Place
from pvegpu.core.ports import NodeFiles
from pvegpu.core.qemuconf import normalize_bus_id, parse_hostpci, parse_pci_mapping, same_device
from pvegpu.core.units import mib
from pvegpu.gate.decide import GatePolicy, GatePorts

VFIO = "vfio-pci"
NVIDIA = "nvidia"


@dataclass(frozen=True)
class VmDevice:
    """One PCI device a VM's ``hostpciN`` takes at start, with the driver bound to it now."""

    key: str  # hostpci0
    bus_id: str  # normalised, e.g. 0000:41:00.0 (the function probed when the config names all functions)
    mapping: str | None
    taken: bool  # False: driver=keep or a mediated device; the host driver keeps it
    driver: str | None  # "" no driver bound, None no such device on this node


def vm_devices(conf_text: str, mapping_text: str | None, node: str, files: NodeFiles) -> tuple[list[VmDevice], list[str]]:
    """The PCI devices the VM's config grants on this node, and notes (mappings without a device here)."""
    out: list[VmDevice] = []
    notes: list[str] = []
    mappings = parse_pci_mapping(mapping_text or "", node)
    for e in parse_hostpci(conf_text):
        ids = e.ids
        if e.mapping is not None:
            ids = mappings.get(e.mapping, ())
            if not ids:
                notes.append(f"{e.key}: mapping {e.mapping} has no device on {node}")
        for raw in ids:
            bus = normalize_bus_id(raw)
            if bus is None:
                notes.append(f"{e.key}: {raw!r} is not a PCI address")
                continue
            probe = bus.replace(".*", ".0")  # all functions: the GPU is function 0
            out.append(VmDevice(e.key, probe, e.mapping, e.driver != "keep" and not e.mdev, files.pci_driver(probe)))
    return out, notes


@dataclass
class VmCheck:
    """The VM gate's verdict: the same shape as a container's (allow, reasons, fix), per device."""

    vmid: int
    allow: bool = True
    reasons: list[str] = field(default_factory=list)
    fix: list[str] = field(default_factory=list)
    devices: list[dict[str, Any]] = field(default_factory=list)

    def refuse(self, reason: str, fix: str | None = None) -> None:
        self.allow = False
        self.reasons.append(reason)
        if fix and fix not in self.fix:
            self.fix.append(fix)

    def text(self) -> str:
        """One paragraph for the PVE task log."""
        if self.allow:
            extra = ("; " + "; ".join(self.reasons)) if self.reasons else ""
            return f"pvegpu: VM {self.vmid} may start: no host or container process holds its GPUs{extra}."
        fix = ("; fix: " + "; ".join(self.fix)) if self.fix else ""
        return f"pvegpu: refusing to start VM {self.vmid}: " + "; ".join(self.reasons) + fix + "."

    def to_json(self) -> dict[str, Any]:
        return {"vmid": self.vmid, "type": "qemu", "allow": self.allow, "reasons": self.reasons, "fix": self.fix,
                "devices": self.devices}


def _free_hint(h: Holder, gpu: GpuInfo) -> str:
    p = h.info.placement
    if p.place is Place.CONTAINER and p.vmid is not None:
        return (f"`pvegpu reset {p.vmid} --no-restart` (or `pct stop {p.vmid}`), and drop the GPU from CT {p.vmid}'s config "
                "while the VM has it")
    if h.info.comm == "nvidia-persiste":  # the kernel cuts comm to 15 characters
        return f"`nvidia-smi -i {gpu.index} -pm 0` or `systemctl stop nvidia-persistenced`"
    return f"stop pid {h.pid} (`kill {h.pid}`, or the service that runs it)"


def check_device(chk: VmCheck, dev: VmDevice, gpu: GpuInfo | None, facts: GpuFacts | None, policy: GatePolicy) -> str:
    """One device's verdict (added to ``chk``): clean / vfio / absent / kept / other-driver / refused / unknown."""
    label = f"{dev.key} ({dev.bus_id}" + (f", mapping {dev.mapping}" if dev.mapping else "") + ")"
    if not dev.taken:
        chk.reasons.append(f"{label} stays on the host driver (driver=keep or vGPU): not checked")
        return "kept"
    if dev.driver is None:
        chk.reasons.append(f"{label}: no such PCI device on this node (PVE refuses the start itself)")
        return "absent"
    if dev.driver == VFIO:
        return "vfio"
    if dev.driver == "":
        return "clean"
    if dev.driver != NVIDIA:
        chk.reasons.append(f"{label} is bound to {dev.driver}, not nvidia: pvegpu checks only nvidia holders")
        return "other-driver"
    if gpu is None or facts is None or not facts.sample.known:
        why = facts.sample.error if facts is not None and facts.sample.error else "host NVML does not list it"
        msg = f"{label} is bound to nvidia but cannot be read: {why}"
        if policy.allow_unknown:
            chk.reasons.append(msg + " (allowed: gate.on_unknown = allow)")
            return "unknown"
        chk.refuse(msg, "check `nvidia-smi`; to start anyway set gate.on_unknown = \"allow\" in /etc/pvegpu/pvegpu.toml")
        return "unknown"
    g = f"{label}, GPU {gpu.index} (/dev/nvidia{gpu.minor})"
    holders = [h for h in facts.ct_holders + facts.other_holders if h.info.state not in ("Z", "X")]
    if holders:
        names = ", ".join(f"pid {h.pid} ({h.info.comm}, {place_name(h.info.placement)})" for h in holders[:8])
        more = f" and {len(holders) - 8} more" if len(holders) > 8 else ""
        chk.refuse(f"{g} is in use through the host's nvidia driver: {names}{more}; unbinding it for VM {chk.vmid} would block or fail half-way",
                   None)
        for h in holders[:8]:
            hint = _free_hint(h, gpu)
            if hint not in chk.fix:
                chk.fix.append(hint)
        return "refused"
    if facts.unexplained_ghosts:
        chk.refuse(f"{g}: NVML lists pid(s) {', '.join(map(str, facts.unexplained_ghosts))} that no longer exist",
                   "pvegpu audit   # find the holder")
        return "refused"
    lo = leftover(facts, policy.rule)  # the one leftover rule (no holder is left here: it is all residue)
    if lo.over or not lo.known:
        held = mib(lo.net_bytes, "an unknown amount")
        chk.refuse(f"{g} holds {held} with no process holding it (leftover or driver leak)", gpu_reset_advice(facts))
        return "refused"
    return "clean"


def evaluate_vm(vmid: int, guest: Guest, ports: GatePorts, files: NodeFiles, policy: GatePolicy) -> VmCheck:
    """Decide whether VM ``vmid`` may start now (``/etc/pve``, sysfs, NVML and ``/proc`` only; never the API)."""
    local = ports.pve.local_node()
    if local is not None and guest.node != local:
        raise NotFoundError(f"VM {vmid} lives on node {guest.node}, this is {local}", f"run it there: `ssh {guest.node} pvegpu check {vmid}`")
    conf = files.read_pve(f"nodes/{guest.node}/qemu-server/{vmid}.conf")
    if conf is None:
        raise NotFoundError(f"cannot read the config of VM {vmid} (nodes/{guest.node}/qemu-server/{vmid}.conf)", f"`qm config {vmid}`")
    chk = VmCheck(vmid)
    devices, notes = vm_devices(conf, files.read_pve("mapping/pci.cfg"), guest.node, files)
    chk.reasons.extend(notes)
    if not devices:
        chk.reasons.append("no PCI passthrough device on this node")
        return chk
    need = [d for d in devices if d.taken and d.driver == NVIDIA]
    facts: dict[int, GpuFacts] = {}
    gpus: list[GpuInfo] = []
    error: str | None = None
    if need:
        try:
            gpus = list(ports.probe.gpus())
        except GpuQueryError as exc:
            error = exc.message
        mine = [g for g in gpus if any(same_device(d.bus_id, g.bus_id) for d in need)]
        if mine:  # every process on the node: a fork child NVML never lists, a container's mknod'ed copy of the node
            facts = inspect_gpus(None, mine, host=ports.host, probe=ports.probe, whole_host=True)
    for d in devices:
        gpu = next((g for g in gpus if same_device(d.bus_id, g.bus_id)), None)
        f = facts.get(gpu.minor) if gpu is not None else None
        if f is None and error is not None and d.driver == NVIDIA:
            f = GpuFacts(GpuInfo(-1, -1, "?", d.bus_id), GpuSample(-1, None, None, error))
        state = check_device(chk, d, gpu, f, policy)
        chk.devices.append({"key": d.key, "bus_id": d.bus_id, "mapping": d.mapping, "driver": d.driver, "state": state,
                            "minor": gpu.minor if gpu else None, "uuid": gpu.uuid if gpu else None,
                            "holders": [] if f is None else sorted({h.pid for h in f.ct_holders + f.other_holders})})
    return chk


def vm_verdict(vmid: int, ports: GatePorts, policy: GatePolicy, files: Callable[[], NodeFiles]) -> dict[str, Any] | None:
    """The gate's verdict for a VM, as ``hook`` passes it out of the bounded child; None when ``vmid`` is not a VM."""
    guest = ports.pve.where(vmid)
    if guest is None or guest.type != "qemu":
        return None
    res = evaluate_vm(vmid, guest, ports, files(), policy)
    return {"allow": res.allow, "text": res.text(), "json": res.to_json(), "kind": "qemu"}
