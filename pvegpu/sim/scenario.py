"""Scenario files for the simulated node, and the SimNode that runs one.

A scenario is JSON (or the equivalent dict)::

    {
      "node": "pve-sim",
      "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771,
                "leak_mib": 0, "fail": null, "hang": 0}],
      "containers": [
        {"vmid": 129, "name": "llm129", "status": "running", "gpus": [0],
         "workloads": [{"kind": "simple", "gpu": 0, "mib": 2048}],
         "config": "optional raw .conf text (replaces the one generated from gpus)",
         "lock": null, "ha_managed": false, "start_error": null, "on_restart": []}
      ],
      "vms": [{"vmid": 200, "name": "win11", "config": "optional raw .conf text"}],
      "pci": {"0000:41:00.0": "nvidia"}
    }

``ha`` (optional) holds the node's HA files (``/etc/pve/ha/``): file name (resources.cfg, groups.cfg, rules.cfg) ->
text; without a resources.cfg there, one is written for the containers with ``"ha_managed": true`` (PVE's defaults).
``kernel_driver`` (optional) is the host's NVIDIA kernel module version (the node's ``proc/driver/nvidia/version``);
a container's ``user_libs`` is the version of the NVIDIA libraries in its root (``ct-root/<vmid>/usr/lib/x86_64-linux-gnu``).
``kernel_log`` (optional) is the node's kernel log since boot, one text a record (``"NVRM: Xid (PCI:0000:41:00): 79,
pid=..., GPU has fallen off the bus."``), and a GPU's ``xids`` (``[{"code": 79, "at": 120, "text": "..."}]``, ``at`` in
seconds since boot) add the driver's Xid lines for its bus id; both are written to ``DIR/kmsg`` in ``/dev/kmsg``'s format,
read through the one reader (``adapters/kernlog.py``). A GPU's ``recovery_action``, ``lost``, ``ecc_volatile_uncorrected``
and ``persistence_mode`` are its NVML health (``sim/nvml.py``).
``pci`` is the simulated node's sysfs: PCI bus id -> the driver bound to it ("" none), for the VM gate and audit.
``settings`` (optional) are settings for runs on this node (``{"reset.timeout": 2}``: a demo's short waits); they
stand in for the settings file there, and an option on the line or a ``PVEGPU_*`` variable still wins.
Workload kinds: ``simple``, ``fork``, ``orphan``, ``ignore-term``, ``respawn``, ``init`` (see ``pvegpu.sim.workload``;
``init``: the container's PID 1 is that GPU job, as in an application container, whose config then names its
``"entrypoint"``: the command PVE 9.1 writes from an OCI image), and ``tp``, a tensor-parallel job::

    {"kind": "tp", "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "mib": 76000, "fork_child_of_rank": 1, "driver_keeps_rank": 1}

one rank process per GPU of ``gpus`` (rank i allocates ``mib`` on the i-th only, every rank holds every one's device
node); ``fork_child_of_rank`` (optional): that rank forks a child that keeps its context after it dies;
``driver_keeps_rank`` (optional): the driver keeps that rank's memory once its every holder is gone.
A GPU plays ``/dev/nvidia<minor>`` with a stand-in the workload processes open: by default the node's own empty
file ``DIR/dev/nvidia<minor>``, matched by its inode, so no other node (nor anything else on the machine) holds
it; ``"mappable": true`` makes it one page the workloads also map, as CUDA maps the device. ``stand_in`` names
another file or a character device (e.g. ``/dev/zero``); a device is matched by its device number, so every
process on the machine that opens it counts as a holder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import tempfile
from typing import Any

from pvegpu.core.errors import UsageError
from pvegpu.core.ha import FILES as HA_FILES
from pvegpu.health import describe
from pvegpu.sim import smi
from pvegpu.sim.host import SessionHost
from pvegpu.sim.init import processes
from pvegpu.sim.nvml import SimNvml, sim_bus_id
from pvegpu.sim.pve import SimPve, start_init
from pvegpu.sim.sessions import kill_session
from pvegpu.sim.state import DIR_FLAGS, DIR_MODE, SimState, read_json
from pvegpu.sim.trust import SCENARIO, check_node

KINDS = ("simple", "fork", "orphan", "ignore-term", "respawn", "init", "tp")

DEMO: dict[str, Any] = {
    "node": "pve-sim",
    "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}],
    "containers": [
        {"vmid": 129, "name": "llm129", "status": "running", "gpus": [0],
         "workloads": [{"kind": "simple", "gpu": 0, "mib": 2048},
                       {"kind": "fork", "gpu": 0, "mib": 1024},
                       {"kind": "ignore-term", "gpu": 0, "mib": 512}]},
        {"vmid": 130, "name": "train130", "status": "running", "gpus": [0], "hookscript": "local:snippets/pvegpu-guard",
         "workloads": [{"kind": "respawn", "gpu": 0, "mib": 3072}]},  # only a restart helps; pvegpu's guard runs at its start
        {"vmid": 131, "name": "shared131", "status": "running", "gpus": [0],
         "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024}]},
    ],
    "vms": [{"vmid": 200, "name": "win11"}],
}

IDLE: dict[str, Any] = {  # nothing holds the GPU: check allows, audit has nothing to say, hook install guards CT 129
    "node": "pve-sim",
    "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}],
    "containers": [{"vmid": 129, "name": "llm129", "status": "stopped", "gpus": [0], "workloads": []}],
}

LEAK: dict[str, Any] = {  # CT 129's job leaves 1 GiB behind when it dies: reset stops it, restarts, still exit 7
    "node": "pve-sim",
    "settings": {"reset.grace": 1, "reset.kill_wait": 1, "reset.timeout": 2},  # a demo: each wait for the leaked memory is short
    "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}],
    "containers": [{"vmid": 129, "name": "llm129", "status": "running", "gpus": [0],
                    "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024, "leak": True}]}],
}

APP: dict[str, Any] = {  # PVE 9.1 application container: CT 129's PID 1 is its GPU job (its OCI image's entrypoint)
    "node": "pve-sim",
    "settings": {"reset.timeout": 5},
    "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}],
    "containers": [{"vmid": 129, "name": "vllm129", "status": "running", "gpus": [0],
                    "entrypoint": "vllm serve /models/llama --tensor-parallel-size 1",
                    "workloads": [{"kind": "init", "gpu": 0, "mib": 4096}],
                    "on_restart": [{"kind": "init", "gpu": 0, "mib": 4096}]}],  # its restart starts the server again
}

_H200 = {"name": "Simulated H200", "total_mib": 143771, "mappable": True}  # mapped, as CUDA maps the device: a fork heir is seen
TP8: dict[str, Any] = {  # the incident pvegpu exists for: a TP=8 job whose one rank's fork child keeps GPU 1 after the ranks die
    "node": "pve-sim",
    "gpus": [{"minor": m, "index": m} | _H200 for m in range(8)],
    "containers": [
        {"vmid": 129, "name": "llm129", "status": "running", "gpus": list(range(8)),
         "workloads": [{"kind": "tp", "gpus": list(range(8)), "mib": 76000, "fork_child_of_rank": 1}]},
        {"vmid": 130, "name": "embed130", "status": "running", "gpus": [3],  # a neighbour on GPU 3: never touched, never counted
         "workloads": [{"kind": "simple", "gpu": 3, "mib": 4096}]},
    ],
}

HEALTH: dict[str, Any] = {  # GPU 0 logged Xid 119 (GSP timeout) and NVML asks for a GPU reset: the gate refuses CT 130's
    "node": "pve-sim",       # start; `pvegpu gpu-reset 0` stops CT 129, resets, verifies, starts it again; then CT 130 may start
    "settings": {"gpureset.client_wait": 1},
    "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771, "recovery_action": "gpu-reset",
              "persistence_mode": True, "xids": [{"code": 119, "at": 120}]}],
    "containers": [
        {"vmid": 129, "name": "llm129", "status": "running", "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 2048}]},
        {"vmid": 130, "name": "train130", "status": "stopped", "gpus": [0], "workloads": []},
    ],
}

SCENARIOS: dict[str, dict[str, Any]] = {"demo": DEMO, "idle": IDLE, "leak": LEAK, "app": APP, "tp8": TP8, "health": HEALTH}  # `pvegpu sim create DIR --scenario NAME`


def ct_conf(ct: dict[str, Any]) -> str:
    if ct.get("config"):
        return str(ct["config"]).rstrip("\n") + "\n"
    lines = ["arch: amd64", f"hostname: {ct.get('name', 'ct%d' % ct['vmid'])}", "memory: 8192", "ostype: debian",
             f"rootfs: local-zfs:subvol-{ct['vmid']}-disk-0,size=8G", "unprivileged: 1"]
    devs = [f"/dev/nvidia{m}" for m in ct.get("gpus", [])] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    lines += [f"dev{i}: {p},gid=44" for i, p in enumerate(devs)]
    if ct.get("hookscript"):
        lines.append(f"hookscript: {ct['hookscript']}")
    if ct.get("entrypoint"):  # an application container, as pve-container writes one (with cmode console)
        lines += [f"entrypoint: {ct['entrypoint']}", "cmode: console"]
    if ct.get("lock"):
        lines.append(f"lock: {ct['lock']}")
    return "\n".join(sorted(lines)) + "\n"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # a node's or a driver's name: one path component, never ".."
VERSION = re.compile(r"[0-9]{1,4}(?:\.[0-9]{1,4}){1,3}")
BUS_ID = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


def validate(sc: dict[str, Any]) -> None:
    """Every problem of the scenario as one UsageError, before anything is laid out or started."""
    problems: list[str] = []
    if not isinstance(sc.get("node", "pve-sim"), str) or not NAME.fullmatch(sc.get("node", "pve-sim")):
        problems.append(f"node {sc.get('node')!r}: must be a node name (letters, digits, '.', '_', '-')")
    pci = sc.get("pci") or {}
    if not isinstance(pci, dict) or not all(isinstance(b, str) and BUS_ID.fullmatch(b) and isinstance(d, str) and (not d or NAME.fullmatch(d))
                                            for b, d in pci.items()):
        problems.append("pci: must map PCI bus ids (0000:41:00.0) to a driver name or \"\"")
    versions = [sc.get("kernel_driver")] + [c.get("user_libs") for c in sc.get("containers", []) or [] if isinstance(c, dict)]
    if not all(v is None or (isinstance(v, str) and VERSION.fullmatch(v)) for v in versions):
        problems.append("kernel_driver / user_libs: must be a driver version (550.54.15)")
    ha = sc.get("ha") or {}
    if not isinstance(ha, dict) or not all(k in HA_FILES and isinstance(v, str) for k, v in ha.items()):
        problems.append(f"ha: must map HA file names ({', '.join(HA_FILES)}) to their text")
    settings = sc.get("settings") or {}
    if not isinstance(settings, dict) or not all(isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in settings.items()):
        problems.append('settings: must map setting names ("reset.timeout") to plain values')
    gpus = sc.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        problems.append("no gpus")
        gpus = []
    minors: set[int] = set()
    for g in gpus:
        if not isinstance(g, dict) or not _is_int(g.get("minor")) or ("stand_in" in g and not os.path.exists(str(g["stand_in"]))):
            problems.append(f"gpu {g.get('minor') if isinstance(g, dict) else g!r}: needs an integer minor (and an existing stand_in, if named)")
            continue
        if g["minor"] in minors:
            problems.append(f"gpu {g['minor']}: duplicate minor")
        minors.add(g["minor"])
    for g in gpus:
        xids = g.get("xids", []) if isinstance(g, dict) else []
        if not isinstance(xids, list) or not all(isinstance(x, dict) and _is_int(x.get("code")) and isinstance(x.get("at", 0), int | float)
                                                 for x in xids):
            problems.append(f"gpu {g.get('minor')!r}: xids must be a list of {{\"code\": N, \"at\": seconds}}")
    log = sc.get("kernel_log") or []
    if not isinstance(log, list) or not all(isinstance(line, str) for line in log):
        problems.append("kernel_log: must be a list of strings")
    seen: set[int] = set()
    guests = [("CT", c) for c in sc.get("containers", []) or []] + [("VM", v) for v in sc.get("vms", []) or []]
    for kind, guest in guests:
        if not isinstance(guest, dict):
            problems.append(f"{'container' if kind == 'CT' else 'vm'} {guest!r}: must be an object")
            continue
        vmid: Any = guest.get("vmid")
        if not _is_int(vmid) or not 100 <= vmid <= 999_999_999:
            problems.append(f"{kind} vmid {vmid!r}: must be an integer 100..999999999")
            continue
        if vmid in seen:
            problems.append(f"{kind} {vmid}: duplicate vmid")
        seen.add(vmid)
        if kind == "VM":
            continue
        for m in guest.get("gpus", []) or []:
            if not _is_int(m) or m not in minors:
                problems.append(f"CT {vmid}: GPU {m!r} is not defined in gpus")
        for w in (guest.get("workloads", []) or []) + (guest.get("on_restart", []) or []):
            if not isinstance(w, dict):
                problems.append(f"CT {vmid}: workload {w!r} must be an object")
                continue
            if w.get("kind", "simple") not in KINDS:
                problems.append(f"CT {vmid}: unknown workload kind {w.get('kind')!r} (one of {', '.join(KINDS)})")
            if w.get("kind") == "tp":
                problems.extend(f"CT {vmid}: {p}" for p in _tp_problems(w, minors))
            elif not _is_int(w.get("gpu", 0)) or w.get("gpu", 0) not in minors:
                problems.append(f"CT {vmid}: workload on GPU {w.get('gpu')!r}, which is not defined in gpus")
            if not _is_int(w.get("mib", 0)) or w.get("mib", 0) < 0:
                problems.append(f"CT {vmid}: workload mib {w.get('mib')!r} must be a whole number >= 0")
        ep = guest.get("entrypoint")
        if ep is not None and (not isinstance(ep, str) or not ep or any(ord(c) < 32 and c != "\t" for c in ep)):
            problems.append(f"CT {vmid}: entrypoint must be one line of text (a command)")
        for key in ("workloads", "on_restart"):
            if sum(1 for w in guest.get(key, []) or [] if isinstance(w, dict) and w.get("kind") == "init") > 1:
                problems.append(f"CT {vmid}: more than one {key} of kind init (a container has one PID 1)")
    if problems:
        raise UsageError("invalid scenario: " + "; ".join(problems), "see `pydoc pvegpu.sim.scenario` for the format")


def _tp_problems(w: dict[str, Any], minors: set[int]) -> list[str]:
    """What is wrong with a ``tp`` workload: its GPUs (a non-empty list of distinct defined minors), its variants' ranks."""
    gpus = w.get("gpus")
    if not isinstance(gpus, list) or not gpus or not all(_is_int(g) and g in minors for g in gpus) or len(set(gpus)) != len(gpus):
        return [f"tp workload gpus {gpus!r}: must list distinct GPU minors defined in gpus"]
    return [f"tp workload {key} {w[key]!r}: must be a rank, 0..{len(gpus) - 1}" for key in ("fork_child_of_rank", "driver_keeps_rank")
            if key in w and not (_is_int(w[key]) and 0 <= w[key] < len(gpus))]


class SimNode:
    """A running simulated node in ``root``; ``teardown()`` kills every simulated container.

    Only a node the caller owns alone is used (``trust.check_node``): whoever else could write its files would
    choose what its containers are."""

    def __init__(self, root: str, owns_root: bool = False) -> None:
        check_node(root)
        self.state = SimState(root)
        meta = read_json(os.path.join(root, SCENARIO), {})
        self.scenario: dict[str, Any] = meta if isinstance(meta, dict) else {}
        self.node = str(self.scenario.get("node", "pve-sim"))
        self.owns_root = owns_root

    @property
    def root(self) -> str:
        return self.state.root

    def ports(self, record_dir: str | None = None) -> tuple[SimPve, SimNvml, SessionHost]:
        """The node's PVE, NVML and host (keeping its record of NVML-listed pids in ``record_dir``: ``gate.record_dir``)."""
        return SimPve(self.state, self.node), SimNvml(self.state), SessionHost(self.state, record_dir)

    def teardown(self) -> int:
        """Kill every container's session whose init is provably this node's (``sessions.own_init``: a state file
        never gets another process group killed); remove the directory if this node made it. Returns how many
        processes were killed."""
        killed = sum(kill_session(self.root, ct) for ct in self.state.cts())
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
        return killed


def _new_dir(root: str | None) -> tuple[str, int]:
    """The node's directory, made here (mode 0700, set with fchmod: the umask takes nothing), and a descriptor of it
    that every write of the layout goes through. An existing path is refused, even an empty directory: a directory
    someone else made (or could still change) is never built into."""
    if root is None:
        root = tempfile.mkdtemp(prefix="pvegpu-sim-")  # new, 0700, this process's
    else:
        try:
            os.mkdir(root, DIR_MODE)
        except FileExistsError:
            raise UsageError(f"{root} exists: `sim create` makes the node's directory itself",
                             "name a new directory (it is made, mode 700); `pvegpu sim remove DIR` removes an old node") from None
        except OSError as exc:
            raise UsageError(f"cannot make {root}: {exc.strerror or exc}", "name a new directory in one you can write") from None
    root = os.path.abspath(root)
    try:
        fd = os.open(root, DIR_FLAGS)
    except OSError as exc:  # renamed and replaced by a link, between the mkdir and this open
        raise UsageError(f"{root} changed while it was made ({exc.strerror or exc}): not built", "name a new directory in one only you can write") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or os.listdir(fd):  # another's directory swapped in under the name: build nothing there
        os.close(fd)
        raise UsageError(f"{root} changed while it was made (another directory took its name): not built",
                         "name a new directory in one only you can write")
    os.fchmod(fd, DIR_MODE)
    return root, fd


def build(scenario: dict[str, Any], root: str | None = None, files: dict[str, tuple[bytes, int]] | None = None) -> SimNode:
    """Lay out the node described by ``scenario`` in a new directory (``root``, or a temporary one that teardown
    removes) and start its running containers; ``files``: more files of the node (path in it -> bytes, mode),
    written before any container starts. On any failure what was made goes again (its processes, its directory),
    and the exception carries a note that says so."""
    validate(scenario)
    owns = root is None
    root, fd = _new_dir(root)
    try:
        try:
            _lay_out(scenario, SimState(root, dir_fd=fd), files or {})
            return SimNode(root, owns_root=owns)
        except BaseException as exc:
            exc.add_note(undo(root, fd))
            raise
    finally:
        os.close(fd)


def undo(root: str, fd: int) -> str:
    """Remove a node that failed while it was built: kill its containers' sessions (``kill_session``: only this
    node's), then remove its directory while ``root`` still names the one made (``fd``). Says what it did."""
    killed = sum(kill_session(root, ct) for ct in SimState(root).cts())
    made = os.fstat(fd)
    try:
        now = os.lstat(root)
    except OSError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):
        return f"{root} was moved or replaced while it was built: nothing removed there; remove the node by hand"
    shutil.rmtree(root, ignore_errors=True)
    stopped = f" and stopped the {killed} process(es) it had started" if killed else ""
    return f"removed {root}{stopped}" if not os.path.lexists(root) else f"could not remove {root}{stopped}: remove it by hand"


def _lay_out(scenario: dict[str, Any], state: SimState, files: dict[str, tuple[bytes, int]]) -> None:
    node = str(scenario.get("node", "pve-sim"))
    state.write_json(SCENARIO, scenario | {"node": node})
    state.set_gpus(list(scenario["gpus"]))
    lxc, qemu = f"etc-pve/nodes/{node}/lxc", f"etc-pve/nodes/{node}/qemu-server"
    state.mkdirs(lxc)
    state.mkdirs(qemu)
    state.mkdirs("snippets")
    state.symlink(f"nodes/{node}", "etc-pve/local")
    ids: dict[str, Any] = {}
    for ct in scenario.get("containers", []):
        ids[str(ct["vmid"])] = {"node": node, "type": "lxc", "version": 1}
        state.write(f"{lxc}/{ct['vmid']}.conf", ct_conf(ct).encode("utf-8"))
        state.set_ct(int(ct["vmid"]), {k: v for k, v in ct.items() if k != "config"} | {"status": "stopped"})
    for vm in scenario.get("vms", []):
        ids[str(vm["vmid"])] = {"node": vm.get("node", node), "type": "qemu", "version": 1}
        text = str(vm["config"]).rstrip("\n") + "\n" if vm.get("config") else f"name: {vm.get('name', 'vm')}\nhostpci0: 0000:01:00.0,pcie=1\n"
        state.write(f"{qemu}/{vm['vmid']}.conf", text.encode("utf-8"))
    for bus, driver in (scenario.get("pci") or {}).items():  # sysfs of the simulated node: bus id -> bound driver ("" none)
        dev = f"sys/bus/pci/devices/{bus}"
        state.write(f"{dev}/vendor", b"0x10de\n")
        if driver:
            state.mkdirs(f"sys/bus/pci/drivers/{driver}")
            state.symlink(os.path.join(state.root, "sys", "bus", "pci", "drivers", driver), f"{dev}/driver")
    state.write("kmsg", kernel_log(scenario))
    state.write_json("etc-pve/.vmlist", {"version": 1, "ids": ids})
    ha = dict(scenario.get("ha") or {})
    managed = [c["vmid"] for c in scenario.get("containers", []) if c.get("ha_managed")]
    if managed and "resources.cfg" not in ha:  # HA's own record of what it manages, as `ha-manager add ct:N` writes it
        ha["resources.cfg"] = "".join(f"ct: {v}\n\tstate started\n\n" for v in managed)
    for name, text in ha.items():
        state.write(f"etc-pve/ha/{name}", text.encode("utf-8"))
    if scenario.get("kernel_driver"):
        state.write("proc/driver/nvidia/version", (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {scenario['kernel_driver']}  "
                                                   "Release Build  (simulated)\nGCC version:  gcc version 12.2.0\n").encode())
    for ct in scenario.get("containers", []):
        if ct.get("user_libs"):  # the files `NVIDIA-Linux-*.run --no-kernel-module` installs, by name (empty here)
            lib = f"ct-root/{ct['vmid']}/usr/lib/x86_64-linux-gnu"
            for name in (f"libnvidia-ml.so.{ct['user_libs']}", f"libcuda.so.{ct['user_libs']}"):
                state.write(f"{lib}/{name}", b"")
    state.write("etc-pve/storage.cfg", f"dir: local\n\tpath {state.root}\n\tcontent iso,vztmpl,backup\n".encode())  # `local` is this directory
    state.write(smi.BIN, smi.script(state.root), 0o700)  # the stand-in nvidia-smi `gpu-reset` runs here
    for rel, (data, mode) in files.items():
        state.write(rel, data, mode)
    expected = 0
    for ct in scenario.get("containers", []):
        if ct.get("status", "running") == "running":
            expected += sum(processes(w) for w in ct.get("workloads", []))
            start_init(state, int(ct["vmid"]), expect_contexts=expected)


def kernel_log(scenario: dict[str, Any]) -> bytes:
    """The node's kernel log since boot in ``/dev/kmsg``'s format: its ``kernel_log`` lines, then each GPU's ``xids`` by time."""
    texts: list[tuple[float, str]] = [(i * 0.001, str(line)) for i, line in enumerate(scenario.get("kernel_log") or [])]
    for g in scenario.get("gpus", []):
        bus = sim_bus_id(g).rsplit(".", 1)[0]
        for x in g.get("xids", []) or []:
            what = x.get("text") or describe(int(x["code"])) or "simulated"
            texts.append((float(x.get("at", 60)), f"NVRM: Xid (PCI:{bus}): {int(x['code'])}, pid='<unknown>', name=<unknown>, {what}"))
    texts.sort(key=lambda t: t[0])
    clean = ("".join(c if c.isprintable() else " " for c in text) for _, text in texts)
    return "".join(f"6,{seq},{int(at * 1e6)},-;{text}\n" for seq, ((at, _), text) in enumerate(zip(texts, clean, strict=True))).encode()


def named(name_or_path: str) -> dict[str, Any]:
    """A built-in scenario by name (``SCENARIOS``), else a scenario JSON file."""
    if name_or_path in SCENARIOS:
        return SCENARIOS[name_or_path]
    if not os.path.exists(name_or_path):
        raise UsageError(f"no scenario {name_or_path!r}: neither a built-in one nor a file",
                         f"built-in: {', '.join(SCENARIOS)}; or a JSON file (`pydoc pvegpu.sim.scenario`)")
    return load(name_or_path)


MAX_SCENARIO = 4 * 1024 * 1024  # a scenario is a few KiB of JSON; anything this big is not one
_HINT = "a scenario is a regular JSON file holding an object; see `pydoc pvegpu.sim.scenario`"


def _read_scenario(path: str) -> bytes:
    """The bytes of the regular file ``path`` (as the settings file is read: never blocking on a FIFO, never
    reading a device or an endless file); raises OSError saying why not."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 16, MAX_SCENARIO + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_SCENARIO:
                raise OSError(f"larger than {MAX_SCENARIO // (1024 * 1024)} MiB: not a scenario")
        return b"".join(chunks)
    finally:
        os.close(fd)


def load(path: str) -> dict[str, Any]:
    """The scenario in the JSON file ``path``; UsageError (exit 2, with a hint) when it is no regular file of
    bounded size, no JSON, or no JSON object."""
    try:
        data = json.loads(_read_scenario(path).decode("utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read scenario {path}: {exc.strerror or exc}", _HINT) from None
    except ValueError as exc:
        raise UsageError(f"cannot read scenario {path}: {exc}", _HINT) from None
    if not isinstance(data, dict):
        raise UsageError(f"scenario {path} must be a JSON object, not {type(data).__name__}", _HINT)
    return data


STATE_DIRS = {"lock_dir": "lock", "override_dir": "allow-once"}  # where under the simulated node's dir; else the key's stem


def own_state(s: Any) -> Any:
    """The settings ``s`` of the simulated node in ``s.simulate``, every state directory still at its real default moved
    under the node's directory: a simulated node never touches this node's reset locks or allow-once tokens."""
    changes: dict[str, object] = {}
    for f in dataclasses.fields(s):
        section = getattr(s, f.name)
        if dataclasses.is_dataclass(section) and not isinstance(section, type):
            moved = {g.name: os.path.join(s.simulate, STATE_DIRS.get(g.name, g.name.removesuffix("_dir")))
                     for g in dataclasses.fields(section) if g.name.endswith("_dir") and getattr(section, g.name) == g.default}
            changes.update({f.name: dataclasses.replace(section, **moved)} if moved else {})
    return dataclasses.replace(s, **changes)
