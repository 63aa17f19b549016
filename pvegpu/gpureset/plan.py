"""Step (b) of ``pvegpu gpu-reset``: every guest granted the GPU, every process using it, what will be done to each,
and why the reset cannot work (the refusals known before anything is stopped). Reads only.

Manual equivalent: ``grep -l nvidia<minor> /etc/pve/lxc/*.conf``, ``qm config <vmid> | grep hostpci``,
``fuser -v /dev/nvidia<minor>``, ``nvidia-smi nvlink -s -i N``, ``systemctl is-active nvidia-fabricmanager``.
"""

from __future__ import annotations

from pvegpu.core import errors as E
from pvegpu.core.holders import inspect_gpus
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import GpuHealth, Holder, Place
from pvegpu.core.qemuconf import parse_hostpci, parse_pci_mapping, same_device
from pvegpu.core.safetext import shown
from pvegpu.gpureset.model import ClientPlan, GpuResetPorts, GpuResetReport, GuestPlan, Refusal
from pvegpu.reset.vocab import Diagnosis

REBOOT_ACTIONS = ("node-reboot", "system-reboot")  # NVML's recovery actions a GPU reset does not answer
PERSISTENCED = "nvidia-persiste"  # /proc/<pid>/comm of nvidia-persistenced (cut at 15 characters)
# host clients pvegpu knows, by comm: how to make each let go (and take it up again after the reset)
KNOWN_CLIENTS = {
    "nv-hostengine": "DCGM's host engine: `systemctl stop nvidia-dcgm` (or dcgm), then start it again after the reset",
    "dcgm-exporter": "the DCGM exporter: `systemctl stop dcgm-exporter` (or its container), then start it again",
    "nvidia_gpu_expo": "the GPU exporter: `systemctl stop nvidia_gpu_exporter`, then start it again",
    "nvidia-smi": "another nvidia-smi: let it finish, or end it",
    "Xorg": "an X server: stop the display manager (`systemctl stop display-manager`)",
}


def make_plan(ports: GpuResetPorts, report: GpuResetReport) -> None:
    """Fill ``report`` with the plan: guests, clients, notes and refusals."""
    gpu = report.gpu
    node = ports.pve.local_node() or ""
    report.node = node
    if not node:  # every node's guests would be in the plan, and in the stops: only this node's are on its GPU
        raise E.UsageError("gpu-reset: this node's name cannot be told (/etc/pve/local, the API): nothing was stopped",
                           "check /etc/pve/local and `pvecm nodes`, or set node in pvegpu's settings")
    _guests(ports, report, node)
    running = {g.vmid for g in report.guests if g.type == "lxc" and g.status == "running"}
    facts = inspect_gpus(None, [gpu], host=ports.host, probe=ports.probe, whole_host=True)[gpu.minor]
    report.used_before = facts.sample.used_bytes
    if not facts.sample.known:
        report.notes.append(f"{report.label} cannot be read before the reset: {facts.sample.error}")
    for h in facts.other_holders:
        report.clients.append(_client(ports, report, h, running))
    health = getattr(ports.probe, "health", None)
    read = True
    try:
        report.health = health(gpu.minor) if health is not None else GpuHealth()
    except E.PvegpuError as exc:
        report.health, read = GpuHealth(), False
        report.notes.append(f"its health cannot be read: {exc.message}")
    report.persistence_before = report.health.persistence_mode
    action = report.health.recovery_action
    if action in REBOOT_ACTIONS:
        refuse(report, Refusal.REBOOT, f"NVML says {report.label} needs a {action.replace('-', ' ')} (recovery action {action}): "
               "a GPU reset does not recover it", "drain the node and reboot it (`pvegpu audit` names its guests)")
    elif action is None and read:
        report.notes.append("NVML cannot tell the GPU's recovery action (driver older than R565?): the reset is verified by memory only")
    _fabric(ports, report)


def refuse(report: GpuResetReport, kind: Refusal, problem: str, action: str) -> None:
    report.refusals.append(Diagnosis(kind, problem, action))  # type: ignore[arg-type]  # a Refusal is a closed kind too


def _guests(ports: GpuResetPorts, report: GpuResetReport, node: str) -> None:
    gpu = report.gpu
    mapping = (ports.files.read_pve("mapping/pci.cfg") if ports.files is not None else None) or ""
    for g in sorted(ports.pve.guests(), key=lambda g: g.vmid):
        if g.node != node:
            continue
        if g.type == "lxc":
            try:
                gpus = parse_config(ports.pve.ct_config(g)).gpus
            except E.PvegpuError as exc:
                report.notes.append(f"CT {g.vmid}: its config cannot be read ({exc.message}): if it runs on this GPU, the "
                                    "process scan names it")
                continue
            if not (gpus.all_gpus or gpu.minor in gpus.minors):
                continue
            try:
                st = ports.pve.ct_status(g)
            except E.PvegpuError as exc:
                refuse(report, Refusal.CLIENT, f"CT {g.vmid} is granted the GPU and its state cannot be read: {exc.message}",
                       f"`pct status {g.vmid}`; stop it yourself if it runs, then run pvegpu gpu-reset again")
                continue
            if st.status == "running":
                action = "stop through the API" + (" (HA: requested state stopped)" if st.ha_managed else "") + \
                         ", start again after the reset through the gate, verified running"
            else:
                action = f"left {st.status}; the gate refuses its start while the GPU is reset"
            report.guests.append(GuestPlan(g.vmid, "lxc", g.name, st.status, action, st.ha_managed))
        elif g.type == "qemu" and ports.files is not None:
            _vm(ports, report, g.vmid, g.node, g.name, mapping)


def _vm(ports: GpuResetPorts, report: GpuResetReport, vmid: int, node: str, name: str, mapping: str) -> None:
    assert ports.files is not None
    text = ports.files.read_pve(f"nodes/{node}/qemu-server/{vmid}.conf")
    if text is None:
        report.notes.append(f"VM {vmid}: its config cannot be read: whether it passes this GPU through is unknown")
        return
    maps = parse_pci_mapping(mapping, node)
    for e in parse_hostpci(text):
        ids = maps.get(e.mapping, ()) if e.mapping else e.ids
        if not any(same_device(i, report.gpu.bus_id) for i in ids):
            continue
        driver = ports.files.pci_driver(report.gpu.bus_id.lower()[-12:])
        if driver == "nvidia":
            report.guests.append(GuestPlan(vmid, "qemu", name, "not on it (bound to nvidia)",
                                           f"left alone: its {e.key} names the GPU, but the host driver owns it now"))
            continue
        bound = f"bound to {driver}" if driver else "bound to no driver" if driver == "" else "its driver unknown"
        report.guests.append(GuestPlan(vmid, "qemu", name, bound, "refused: the host driver does not own a passed-through GPU"))
        refuse(report, Refusal.VM_PASSTHROUGH, f"VM {vmid} passes {report.label} through ({e.key}; {bound}): the host driver "
               "does not own it, so nvidia-smi cannot reset it", f"shut the VM down (`qm shutdown {vmid}`); its own reset "
               "happens at its next start (vfio)")
        return


def _client(ports: GpuResetPorts, report: GpuResetReport, h: Holder, running: set[int]) -> ClientPlan:
    """What happens to one process using the GPU; one that will not let go is a refusal."""
    p = h.info.placement
    comm = shown(h.info.comm)
    via = tuple(sorted(h.via))
    if p.place is Place.CONTAINER and p.vmid in running:
        return ClientPlan(h.pid, comm, f"CT {p.vmid}", via, f"ends with CT {p.vmid}'s stop")
    if h.pid == ports.host.self_pid:
        return ClientPlan(h.pid, comm, "host", via, "pvegpu's own NVML handle: closed before the reset")
    if p.place is Place.HOST and h.info.comm == PERSISTENCED:
        return ClientPlan(h.pid, comm, "host", via, "lets go once persistence mode is off for this GPU (restored after)")
    where = {Place.HOST: "host", Place.VM: f"VM {p.vmid}", Place.CONTAINER: f"CT {p.vmid}"}.get(p.place, "unknown")
    how = KNOWN_CLIENTS.get(h.info.comm) or (f"stop its service (`systemctl status {h.pid}` names it) or end it (`kill {h.pid}`)"
                                             if p.place is Place.HOST else f"stop {where}" if p.place is not Place.UNKNOWN
                                             else f"find out what it is (`cat /proc/{h.pid}/cgroup`) and stop it")
    refuse(report, Refusal.CLIENT, f"pid {h.pid} ({comm}, {where}) uses {report.label} and pvegpu does not stop it", how)
    return ClientPlan(h.pid, comm, where, via, "refused: it must let go first")


def _fabric(ports: GpuResetPorts, report: GpuResetReport) -> None:
    nvlinks = getattr(ports.probe, "nvlinks", None)
    links = nvlinks(report.gpu.minor) if nvlinks is not None else None
    if links:
        refuse(report, Refusal.NVLINK, f"{report.label} has {links} active NVLink(s): NVLink peers are reset together, which "
               "`nvidia-smi -r` of one GPU does not do", "reset every GPU of the NVLink domain together or reboot the node")
    elif links is None:
        report.notes.append("NVML cannot tell whether the GPU has active NVLinks: if it has, the reset fails and says so")
    fm = ports.control.fabric_manager()
    if fm:
        refuse(report, Refusal.FABRIC_MANAGER, "NVIDIA Fabric Manager runs on this node (an NVSwitch system): its GPUs are reset "
               "with their partition or the whole node", "reboot the node, or reset through Fabric Manager's own tools")
    elif fm is None:
        report.notes.append("whether NVIDIA Fabric Manager runs cannot be told")
