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

``pci`` is the simulated node's sysfs: PCI bus id -> the driver bound to it ("" none), for the VM gate and audit.
Workload kinds: ``simple``, ``fork``, ``orphan``, ``ignore-term``, ``respawn`` (see ``pvegpu.sim.workload``).
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
import shutil
import stat
import tempfile
from typing import Any

from ..errors import UsageError
from .host import SessionHost
from .nvml import SimNvml
from .pve import SimPve, kill_session, session_is_ours, start_init
from .state import SimState, write_json

KINDS = ("simple", "fork", "orphan", "ignore-term", "respawn")

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
    "gpus": [{"minor": 0, "index": 0, "name": "Simulated H200", "total_mib": 143771}],
    "containers": [{"vmid": 129, "name": "llm129", "status": "running", "gpus": [0],
                    "workloads": [{"kind": "simple", "gpu": 0, "mib": 1024, "leak": True}]}],
}

SCENARIOS: dict[str, dict[str, Any]] = {"demo": DEMO, "idle": IDLE, "leak": LEAK}  # `pvegpu sim create DIR --scenario NAME`


def ct_conf(ct: dict[str, Any]) -> str:
    if ct.get("config"):
        return str(ct["config"]).rstrip("\n") + "\n"
    lines = ["arch: amd64", f"hostname: {ct.get('name', 'ct%d' % ct['vmid'])}", "memory: 8192", "ostype: debian",
             f"rootfs: local-zfs:subvol-{ct['vmid']}-disk-0,size=8G", "unprivileged: 1"]
    devs = [f"/dev/nvidia{m}" for m in ct.get("gpus", [])] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    lines += [f"dev{i}: {p},gid=44" for i, p in enumerate(devs)]
    if ct.get("hookscript"):
        lines.append(f"hookscript: {ct['hookscript']}")
    if ct.get("lock"):
        lines.append(f"lock: {ct['lock']}")
    return "\n".join(sorted(lines)) + "\n"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(sc: dict[str, Any]) -> None:
    """Every problem of the scenario as one UsageError, before anything is laid out or started."""
    problems: list[str] = []
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
            if not _is_int(w.get("gpu", 0)) or w.get("gpu", 0) not in minors:
                problems.append(f"CT {vmid}: workload on GPU {w.get('gpu')!r}, which is not defined in gpus")
            if not _is_int(w.get("mib", 0)) or w.get("mib", 0) < 0:
                problems.append(f"CT {vmid}: workload mib {w.get('mib')!r} must be a whole number >= 0")
    if problems:
        raise UsageError("invalid scenario: " + "; ".join(problems), "see `pydoc pvegpu.sim.scenario` for the format")


class SimNode:
    """A running simulated node in ``root``; ``teardown()`` kills every simulated container."""

    def __init__(self, root: str, owns_root: bool = False) -> None:
        self.state = SimState(root)
        meta = json.load(open(os.path.join(root, "scenario.json")))
        self.node = str(meta["node"])
        self.owns_root = owns_root

    @property
    def root(self) -> str:
        return self.state.root

    def ports(self) -> tuple[SimPve, SimNvml, SessionHost]:
        return SimPve(self.state, self.node), SimNvml(self.state), SessionHost(self.state)

    def teardown(self) -> None:
        for ct in self.state.cts():
            if session_is_ours(self.state, ct):  # a state file names the session: never a process group that is not this node's
                kill_session(ct)
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)


def build(scenario: dict[str, Any], root: str | None = None) -> SimNode:
    """Lay out the node described by ``scenario`` and start its running containers."""
    validate(scenario)
    owns = root is None
    root = root or tempfile.mkdtemp(prefix="pvegpu-sim-")
    try:
        return _lay_out(scenario, root, owns)
    except BaseException:
        if owns:
            shutil.rmtree(root, ignore_errors=True)
        raise


def _lay_out(scenario: dict[str, Any], root: str, owns: bool) -> SimNode:
    state = SimState(root)
    node = str(scenario.get("node", "pve-sim"))
    write_json(os.path.join(root, "scenario.json"), scenario | {"node": node})
    state.set_gpus(list(scenario["gpus"]))
    lxc = os.path.join(state.etc_pve, "nodes", node, "lxc")
    qemu = os.path.join(state.etc_pve, "nodes", node, "qemu-server")
    os.makedirs(lxc, exist_ok=True)
    os.makedirs(qemu, exist_ok=True)
    os.makedirs(state.snippets, exist_ok=True)
    if not os.path.lexists(os.path.join(state.etc_pve, "local")):
        os.symlink(f"nodes/{node}", os.path.join(state.etc_pve, "local"))
    ids: dict[str, Any] = {}
    for ct in scenario.get("containers", []):
        ids[str(ct["vmid"])] = {"node": node, "type": "lxc", "version": 1}
        with open(os.path.join(lxc, f"{ct['vmid']}.conf"), "w") as f:
            f.write(ct_conf(ct))
        state.set_ct(int(ct["vmid"]), {k: v for k, v in ct.items() if k != "config"} | {"status": "stopped"})
    for vm in scenario.get("vms", []):
        ids[str(vm["vmid"])] = {"node": vm.get("node", node), "type": "qemu", "version": 1}
        with open(os.path.join(qemu, f"{vm['vmid']}.conf"), "w") as f:
            f.write(str(vm["config"]).rstrip("\n") + "\n" if vm.get("config") else f"name: {vm.get('name', 'vm')}\nhostpci0: 0000:01:00.0,pcie=1\n")
    for bus, driver in (scenario.get("pci") or {}).items():  # sysfs of the simulated node: bus id -> bound driver ("" none)
        dev = os.path.join(root, "sys", "bus", "pci", "devices", bus)
        os.makedirs(dev, exist_ok=True)
        with open(os.path.join(dev, "vendor"), "w") as f:
            f.write("0x10de\n")
        if driver:
            os.makedirs(os.path.join(root, "sys", "bus", "pci", "drivers", driver), exist_ok=True)
            os.symlink(os.path.join(root, "sys", "bus", "pci", "drivers", driver), os.path.join(dev, "driver"))
    write_json(os.path.join(state.etc_pve, ".vmlist"), {"version": 1, "ids": ids})
    with open(os.path.join(state.etc_pve, "storage.cfg"), "w", encoding="utf-8") as f:  # `local` is this directory: snippets/
        f.write(f"dir: local\n\tpath {root}\n\tcontent iso,vztmpl,backup\n")
    sim = SimNode(root, owns_root=owns)
    expected = 0
    try:
        for ct in scenario.get("containers", []):
            if ct.get("status", "running") == "running":
                expected += len(ct.get("workloads", []))
                start_init(state, int(ct["vmid"]), expect_contexts=expected)
    except BaseException:
        sim.teardown()
        raise
    return sim


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


def require_node(directory: str) -> None:
    """``--simulate DIR``: a UsageError unless ``directory`` holds a simulated node (its ``scenario.json``), hinting
    ``sim create`` of that directory when it could be one (absent or empty), else of a new one (``/etc`` is no node)."""
    if os.path.isfile(os.path.join(directory, "scenario.json")):
        return
    try:
        fresh = not os.path.lexists(directory) or (os.path.isdir(directory) and not os.listdir(directory))
    except OSError:
        fresh = False
    where = directory if fresh else "/tmp/pvegpu-node"
    raise UsageError(f"--simulate {directory}: not a simulated node (no scenario.json there)",
                     f"`pvegpu sim create {where}` builds one{'' if fresh else ' in a new directory'} (README: Simulated node); "
                     "`pvegpu demo` builds and removes one")


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
