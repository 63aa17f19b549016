"""pvegpu against real LXC containers with Proxmox's cgroup layout (lxc/<vmid>/ns, lxc.monitor/<vmid>)."""

from __future__ import annotations

import pytest

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.etcpve import EtcPve
from pvegpu.adapters.procfs import ProcHost
from pvegpu.core.model import Place
from pvegpu.reset import Ports, ResetPolicy, reset
from tests import lxc_lab, pvelike
from tests.fakes import FdBackedProbe

pytestmark = [pytest.mark.lxc, pytest.mark.root, pytest.mark.skipif(lxc_lab.available() is not None, reason=str(lxc_lab.available()))]

CONF = "arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\nlxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
HOLD = "(exec 3<>/dev/nvidia0; trap '' TERM; sleep 1000 & wait) >/dev/null 2>&1 & (sleep 1000) >/dev/null 2>&1 &"


@pytest.fixture
def lab(tmp_path):
    """Three container ids of this run only (never shared with a concurrent run), a PVE-like tree granting them
    the stand-in GPU, and a maker that creates and starts a container; every container made is destroyed."""
    gpu = lxc_lab.StandIn()  # this run's own device number: no other process on the machine holds it
    ids = lxc_lab.claim_vmids(3)
    etc = EtcPve(pvelike.etc_pve(str(tmp_path / "pve"), "lab", {v: CONF for v in ids}))
    made: list[int] = []

    def ct(vmid: int, inittab: str = "") -> None:
        made.append(vmid)
        lxc_lab.make_ct(vmid, gpu, inittab)
        lxc_lab.start(vmid)

    yield etc, ct, ids, gpu.table
    for v in made:
        lxc_lab.destroy(v)
    for v in ids:
        lxc_lab.release_vmid(v)
    gpu.close()


def test_reset_stops_only_target_container_holders(lab):
    """Holders in CT A (one ignoring SIGTERM, its fork-inherited sleep child) are stopped; CT B on the
    same device, both inits and both lxc monitors survive; the memory stand-in returns. (Holders outside
    this run's two containers, e.g. another process on the stand-in device, are not asserted on.)"""
    etc, ct, (a, b, _), table = lab
    ct(a)
    ct(b)
    lxc_lab.attach(a, HOLD)
    lxc_lab.attach(b, HOLD)
    host = ProcHost(table)
    before_b = set(host.ct_pids(b))
    monitors = {p: i.placement.vmid for p in host.all_pids() if (i := host.describe(p)) and i.placement.place is Place.MONITOR
                and i.placement.vmid in (a, b)}
    api = lxc_lab.LxcPve(etc)
    rep = reset(a, Ports(api, FdBackedProbe(host), host, SystemClock()), ResetPolicy(grace=1.0, timeout=5, restart=False))
    assert rep.outcome == "clean", rep.diagnosis
    sent = [s for s in rep.signalled if s["result"] == "sent"]
    assert {s["signal"] for s in sent} == {"SIGKILL"}  # trap '' TERM (inherited by its child): SIGTERM would be dropped
    assert all(s["cgroup"].startswith(f"/lxc/{a}/ns") and s["ns_pid"] != 1 for s in sent)
    assert api.calls == [] and lxc_lab.running(a) and lxc_lab.running(b)
    assert before_b <= set(host.ct_pids(b))  # nothing of B was touched
    assert set(monitors.values()) == {a, b} and all(host.describe(p) is not None for p in monitors)
    ours = [h for h in rep.after[0].other_holders if h.info.placement.vmid in (a, b)]
    assert ours and all(h.info.placement.vmid == b for h in ours)


def test_respawning_holder_forces_verified_restart(lab):
    """A holder busybox init respawns (about 1 s later) is fought for the rounds when settle outlasts the respawn
    delay, then the CT is restarted with lxc-stop/lxc-start and the device verified free while it was stopped."""
    etc, ct, (_, _, c), table = lab
    ct(c, "::respawn:/bin/sh -c 'exec 3<>/dev/nvidia0; exec sleep 1000'\n")
    host = ProcHost(table)
    rep = reset(c, Ports(lxc_lab.LxcPve(etc), FdBackedProbe(host), host, SystemClock()), ResetPolicy(grace=1.0, timeout=5, rounds=2, settle=2.0))
    assert any(s.name == "respawn" for s in rep.steps)
    assert rep.restarted and rep.outcome == "clean" and rep.exit_code == 0
    assert lxc_lab.running(c)


def test_dry_run_lists_holders_and_spares_init(lab):
    """--dry-run on a real CT lists its holders with container pids, marks nothing for the init, signals nothing."""
    etc, ct, (a, _, _), table = lab
    ct(a)
    lxc_lab.attach(a, HOLD)
    host = ProcHost(table)
    rep = reset(a, Ports(lxc_lab.LxcPve(etc), FdBackedProbe(host), host, SystemClock()), ResetPolicy(dry_run=True))
    planned = [p for p in rep.plan if p["action"].startswith("SIGKILL at once")]  # HOLD traps TERM: SIGTERM cannot reach them
    assert len(planned) == 2 and all(p["ns_pid"] not in (None, 1) for p in planned)
    # nothing of the CT was stopped: the planned holders are all still there (lxc-attach's own shell may come and go)
    assert rep.signalled == [] and {p["pid"] for p in planned} <= set(host.ct_pids(a))


def test_guarded_restart_passes_its_own_lock(lab, tmp_path):
    """pvegpu's guard as the CT's hookscript, run at the restart's start as PVE runs it, while the reset holds its
    lock: the start passes (the reset's own start mark), the CT runs again, exit 0; the guard said why."""
    from pvegpu.adapters.locks import ct_lock

    etc, ct, (_, _, c), table = lab
    ct(c, "::respawn:/bin/sh -c 'exec 3<>/dev/nvidia0; exec sleep 1000'\n")
    guard = pvelike.guard(str(tmp_path), pvelike.launcher(str(tmp_path)))
    locks = str(tmp_path / "locks")
    env = {"PVEGPU_PVE_ROOT": etc.root, "PVEGPU_RESET_LOCK_DIR": locks, "PVEGPU_GATE_ON_UNKNOWN": "allow"}  # no NVML here
    api = lxc_lab.LxcPve(etc, guard=guard, guard_env=env)
    host = ProcHost(table)
    with ct_lock(locks, c, 0) as lock:
        ports = Ports(api, FdBackedProbe(host), host, SystemClock(), lock=lock)
        rep = reset(c, ports, ResetPolicy(grace=1.0, timeout=5, rounds=1, settle=2.0))
    assert rep.restarted and rep.exit_code == 0 and not rep.left_stopped, (rep.diagnosis, api.hook_log)
    assert any("restart of pvegpu reset" in line for line in api.hook_log) and lxc_lab.running(c)
