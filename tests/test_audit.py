"""The audit core on in-memory fakes: typed rows, attribution with NVML's numbers, each flag and its advice, unknown never 0."""

from __future__ import annotations

import dataclasses

from pvegpu.audit.guests import device_paths
from pvegpu.audit.model import FlagKind, GpuRow, HolderRow
from pvegpu.audit.run import audit_document, audit_once, run_audit
from pvegpu.core.errors import GpuQueryError
from pvegpu.core.leftover import LeftoverRule
from pvegpu.core.model import MIB, GpuHealth, Placement
from pvegpu.sim.driver import context_gap
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve


class FakeFiles:
    """NodeFiles over a set of existing paths and a dict of /etc/pve texts and PCI devices."""

    def __init__(self, existing=(), pve=None, pci=None, snippets="/var/lib/vz/snippets"):
        self.existing = set(existing)
        self.pve = dict(pve or {})
        self.pci = dict(pci or {})  # bus id -> (driver, vendor)
        self.snippets = snippets

    def exists(self, path):
        return path in self.existing

    def snippet_path(self, volid):
        return f"{self.snippets}/{volid.split('snippets/', 1)[1]}" if ":snippets/" in volid else None

    def read_pve(self, relpath):
        return self.pve.get(relpath)

    def running_cts(self):
        return None  # cannot tell: the audit falls back to the container's cgroup

    def pci_driver(self, bus_id):
        return self.pci[bus_id][0] if bus_id in self.pci else None

    def pci_vendor(self, bus_id):
        return self.pci[bus_id][1] if bus_id in self.pci else None

    def driver_version(self):
        return None  # unreadable: every container's driver check is unknown

    def ct_lib_versions(self, vmid, init_pid):
        return None


NODES = {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"}


def node(minors=(0,)):
    host = FakeHost(FakeClock())
    return host, FakeProbe(host, minors), FakePve(host)


def kinds(rep):
    return {f.kind for f in rep.flags}


def test_two_containers_and_a_host_process_attributed_with_nvml_numbers():
    """Each holder is a typed row: place, vmid, hostname, pid inside, NVML's bytes; shared + host holder flagged."""
    host, probe, pve = node()
    pve.add_ct(129)
    pve.add_ct(130)
    pve.configs[129] += "hostname: llm129\n"
    a, b, h = host.add(129, minors={0}), host.add(130, minors={0}), host.add(None, minors={0}, comm="smi-loop")
    probe.context(0, 1000, a)
    probe.context(0, 2000, b)
    probe.context(0, 300, h)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    row = rep.gpus[0]
    assert isinstance(row, GpuRow) and all(isinstance(x, HolderRow) for x in row.holders)
    by_pid = {x.pid: x for x in row.holders}
    assert (by_pid[a.pid].place, by_pid[a.pid].vmid, by_pid[a.pid].hostname, by_pid[a.pid].used_bytes) == ("lxc", 129, "llm129", 1000 * MIB)
    assert by_pid[a.pid].ns_pid == a.pid - 4000 and by_pid[b.pid].guest_id == "lxc/130"
    assert (by_pid[h.pid].place, by_pid[h.pid].vmid, by_pid[h.pid].used_bytes) == ("host", None, 300 * MIB)
    # NVML's used includes the per-context gap (driver model); unattributed is net of the allowance for 3 contexts
    assert row.used_bytes == 3300 * MIB + context_gap(3) and row.granted_to == ["lxc/129", "lxc/130"]
    assert row.allowance_bytes == 3 * LeftoverRule().per_context_bytes and row.unattributed_bytes == max(0, context_gap(3) - row.allowance_bytes)
    assert kinds(rep) == {FlagKind.SHARED, FlagKind.HOST_HOLDER} and rep.attention


def test_shared_alone_needs_no_attention():
    """Two containers sharing a GPU by design is reported, with advice, but exit stays 0 (attention False)."""
    host, probe, pve = node()
    for vmid in (129, 130):
        pve.add_ct(vmid)
        probe.context(0, 100, host.add(vmid, minors={0}))
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert kinds(rep) == {FlagKind.SHARED} and not rep.attention
    assert "never touches the others" in rep.flags[0].to_json()["advice"]


def test_dead_pid_still_listed_is_flagged():
    """NVML listing the pid of a dead owner whose child keeps the context: dead-pid flag, the child is the holder."""
    host, probe, pve = node()
    pve.add_ct(129)
    owner, child = host.add(129, minors={0}), host.add(129, minors={0})
    probe.context(0, 500, owner, child)
    del host.procs[owner.pid]
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert rep.gpus[0].dead_pids == [owner.pid] and [x.pid for x in rep.gpus[0].holders] == [child.pid]
    assert FlagKind.DEAD_PID in kinds(rep) and rep.attention


def test_unattributed_memory_over_the_threshold_only():
    """Memory no live holder explains is flagged above the threshold, not below; the row carries the bytes."""
    host, probe, pve = node()
    probe.leak[0] = 300 * MIB
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert rep.gpus[0].unattributed_bytes == 300 * MIB and FlagKind.UNATTRIBUTED in kinds(rep)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES), threshold_bytes=512 * MIB)
    assert FlagKind.UNATTRIBUTED not in kinds(rep) and not rep.attention


def test_unreadable_gpu_is_an_error_row_that_hides_nothing():
    """GPU 1 lost: its row says why and has no numbers (None, not 0); GPU 0 is still read and attributed."""
    host, probe, pve = node((0, 1))
    pve.add_ct(129)
    probe.context(0, 100, host.add(129, minors={0}))
    probe.fail.add(1)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    ok, bad = rep.gpus
    assert ok.error is None and ok.used_bytes == 100 * MIB + context_gap(1) and len(ok.holders) == 1
    assert bad.error and bad.used_bytes is None and bad.unattributed_bytes is None and bad.flags == [FlagKind.UNREADABLE]
    assert bad.to_json()["readable"] is False and bad.to_json()["used_mib"] is None and rep.attention


def test_nvml_that_cannot_start_is_a_node_error_and_configs_are_still_checked():
    """NVML down: node error (never zero GPUs silently), the probe is not needed, the configured containers still listed."""
    host, _, pve = node()
    pve.add_ct(129)

    def broken():
        raise GpuQueryError("NVML could not start: Driver Not Loaded")

    rep = audit_once(broken, pve=pve, host=host, files=FakeFiles(NODES))
    assert rep.error and "Driver Not Loaded" in rep.error and rep.gpus == [] and rep.attention
    assert [g.id for g in rep.guests] == ["lxc/129"] and FlagKind.UNREADABLE in kinds(rep)
    assert audit_document([rep])["nodes"][0]["ok"] is False


def test_audit_once_closes_nvml_after_the_run():
    """NVML is opened for one run and closed after it, also when the run raises (no resident client)."""
    host, probe, pve = node()
    closed = []
    probe.close = lambda: closed.append(True)
    audit_once(lambda: probe, pve=pve, host=host, files=FakeFiles(NODES))
    assert closed == [True]

    class Boom(FakePve):
        def guests(self):
            raise RuntimeError("bug")

    try:
        audit_once(lambda: probe, pve=Boom(host), host=host, files=FakeFiles(NODES))
    except RuntimeError:
        pass
    assert closed == [True, True]


def test_missing_device_node_and_missing_hookscript_are_flagged_per_container():
    """A devN node that does not exist (CT cannot start) and a hookscript whose snippet is absent: one flag each, with the paths."""
    host, probe, pve = node()
    pve.add_ct(129, minors=(0, 1))
    pve.configs[129] += "hookscript: local:snippets/pvegpu-guard\nlxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file\n"
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles({"/dev/nvidia0"}))
    flags = {f.kind: f for f in rep.flags}
    assert flags[FlagKind.MISSING_NODE].subject == "lxc/129" and "/dev/nvidia1" in flags[FlagKind.MISSING_NODE].detail
    assert "uvm-tools" not in flags[FlagKind.MISSING_NODE].detail  # optional bind mounts do not stop a start
    assert "/var/lib/vz/snippets/pvegpu-guard" in flags[FlagKind.MISSING_HOOKSCRIPT].detail
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES | {"/var/lib/vz/snippets/pvegpu-guard"}))
    assert not {FlagKind.MISSING_NODE, FlagKind.MISSING_HOOKSCRIPT} & kinds(rep)


def test_wildcard_grant_without_named_nodes_is_flagged():
    """`c 195:* rwm` with no /dev/nvidiaN named grants every GPU: the guest is configured for all, and flagged."""
    host, probe, pve = node((0, 1))
    pve.add_ct(131, minors=())
    pve.configs[131] = "lxc.cgroup2.devices.allow: c 195:* rwm\n"
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert [f.subject for f in rep.flags if f.kind is FlagKind.ALL_GPUS] == ["lxc/131"]
    assert all(g.granted_to == ["lxc/131"] for g in rep.gpus) and rep.guests[0].all_gpus


def test_stopped_and_other_node_containers_are_listed_with_their_status():
    """Stopped GPU containers are listed as stopped; with cluster, other nodes' containers too, status unknown; pending noted."""
    host, probe, pve = node()
    pve.add_ct(129)
    pve.add_ct(140, node="pve2")
    pve.configs[129] += "[pve:pending]\ndev1: /dev/nvidia1\n"
    host.add(129, init=True)
    pve.add_ct(130)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert {g.id: g.status for g in rep.guests} == {"lxc/129": "running", "lxc/130": "stopped"}
    assert any("pending" in n for n in rep.guests[0].notes)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES), cluster=True)
    assert {g.id: (g.node, g.status) for g in rep.guests}["lxc/140"] == ("pve2", "unknown")


def test_unknown_placement_is_shown_as_unknown_never_host():
    """A holder whose placement pvegpu cannot name is 'unknown' with its own flag, not a host process."""
    host, probe, pve = node()
    p = host.add(None, minors={0})
    probe.context(0, 100, p)
    real = host.describe

    def describe(pid):
        i = real(pid)
        return dataclasses.replace(i, placement=Placement("unknown")) if i and pid == p.pid else i  # type: ignore[arg-type]

    host.describe = describe
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert rep.gpus[0].holders[0].place == "unknown" and kinds(rep) == {FlagKind.UNKNOWN_PLACE}


def test_health_pending_remap_is_flagged_and_unknown_stays_none():
    """A pending row remap raises a health flag; readings the probe cannot make stay None in the row and the JSON."""
    host, probe, pve = node((0, 1))
    probe.health = lambda minor: GpuHealth(reserved_bytes=615 * MIB, remap_pending=minor == 1, mig_enabled=False)
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    assert [f.subject for f in rep.flags if f.kind is FlagKind.HEALTH] == ["GPU 1"]
    j = rep.gpus[0].to_json()
    assert j["reserved_bytes"] == 615 * MIB and j["health"]["retired_pages_pending"] is None and j["health"]["remap_pending"] is False


def test_device_paths_from_text_and_api_forms():
    """devN (plain and path=), non-optional bind mounts, API dict with lxc pairs; snapshot sections ignored."""
    text = "dev0: /dev/nvidia0,gid=44\ndev1: path=/dev/nvidiactl\nlxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,create=file\n[snap]\ndev2: /dev/nvidia2\n"
    assert device_paths(text) == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    api = {"dev0": "/dev/nvidia1", "lxc": [["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"]]}
    assert device_paths(api) == ["/dev/nvidia1"]


def test_running_containers_read_once_from_their_cgroups(tmp_path):
    """LocalNodeFiles.running_cts reads populated lxc/<vmid> cgroups (only root creates them); no cgroupfs is None."""
    from pvegpu.adapters.nodefiles import LocalNodeFiles

    (tmp_path / "cgroup.procs").write_text("")
    for vmid, populated in ((129, 1), (130, 0), (131, 1)):
        (tmp_path / "lxc" / str(vmid)).mkdir(parents=True)
        (tmp_path / "lxc" / str(vmid) / "cgroup.events").write_text(f"populated {populated}\nfrozen 0\n")
    (tmp_path / "lxc" / "evil129").mkdir()
    assert LocalNodeFiles(cgroup_root=str(tmp_path)).running_cts() == frozenset({129, 131})
    assert LocalNodeFiles(cgroup_root=str(tmp_path / "none")).running_cts() is None



def test_fork_child_of_a_dead_listed_parent_is_credited_to_its_container():
    """CT 130's fork child holds the 4 GiB context of its dead, still-listed parent, whose process group it is in:
    audit credits those bytes to CT 130 (JSON holder and Prometheus per-guest bytes), as reset credits them."""
    from pvegpu.audit.prom import AuditCollector

    host, probe, pve = node()
    pve.add_ct(130)
    host.add(130, init=True)
    parent = host.add(130, minors={0})
    child = host.add(130, minors={0}, pgid=parent.pid)
    probe.context(0, 4096, parent, child)
    del host.procs[parent.pid]
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    [h] = [h for h in rep.gpus[0].holders if h.pid == child.pid]
    assert (h.inherited_from, h.credited_bytes, h.memory_bytes) == (parent.pid, 4096 * MIB, 4096 * MIB)
    assert h.to_json()["credited_bytes"] == 4096 * MIB
    fams = {f.name: f for f in AuditCollector(audit_document([rep], 0.0)).collect()}
    mem = {s.labels["id"]: s.value for s in fams["pvegpu_guest_gpu_memory_used_bytes"].samples}
    assert mem["lxc/130"] == 4096 * MIB


def test_crowded_gpu_gap_is_allowed_not_flagged():
    """12 containers with one context each: NVML's used exceeds the listed bytes by the per-context gap (more than
    64 MiB); audit reports it net of the allowance and raises no unattributed-memory flag."""
    host, probe, pve = node()
    for vmid in range(130, 142):
        pve.add_ct(vmid)
        probe.context(0, 1024, host.add(vmid, minors={0}))
    rep = run_audit(pve=pve, probe=probe, host=host, files=FakeFiles(NODES))
    row = rep.gpus[0]
    assert row.residual_bytes == context_gap(12) > 64 * MIB and row.contexts == 12
    assert row.unattributed_bytes == max(0, context_gap(12) - 12 * LeftoverRule().per_context_bytes)
    assert FlagKind.UNATTRIBUTED not in kinds(rep)
    j = row.to_json()
    assert j["context_allowance_bytes"] == 12 * LeftoverRule().per_context_bytes and j["threshold_bytes"] == 64 * MIB
