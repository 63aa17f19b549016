"""pvegpu against real LXC containers with Proxmox's cgroup layout (lxc/<vmid>/ns, lxc.monitor/<vmid>)."""

from __future__ import annotations

import os

import pytest

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.etcpve import EtcPve
from pvegpu.adapters.procfs import ProcHost
from pvegpu.model import Place
from pvegpu.reclaim import Ports, ResetPolicy, reset
from tests import lxc_lab, pvelike
from tests.fakes import FdBackedProbe

pytestmark = [pytest.mark.lxc, pytest.mark.root, pytest.mark.skipif(lxc_lab.available() is not None, reason=str(lxc_lab.available()))]

CONF = "arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\nlxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
HOLD = "(exec 3<>/dev/nvidia0; trap '' TERM; sleep 1000 & wait) >/dev/null 2>&1 & (sleep 1000) >/dev/null 2>&1 &"


@pytest.fixture
def lab(tmp_path):
    node = tmp_path / "nvidia0"
    os.mknod(node, 0o666 | 0o020000, lxc_lab.FULL)  # devN-style mknod copy of the stand-in device
    etc = EtcPve(pvelike.etc_pve(str(tmp_path / "pve"), "lab", {941: CONF, 942: CONF, 943: CONF}))
    made: list[int] = []

    def ct(vmid: int, inittab: str = "") -> None:
        made.append(vmid)
        lxc_lab.make_ct(vmid, str(node), inittab)
        lxc_lab.start(vmid)

    yield etc, ct
    for v in made:
        lxc_lab.destroy(v)


def test_reset_stops_only_target_container_holders(lab):
    """Holders in CT 941 (one ignoring SIGTERM, its fork-inherited sleep child) are stopped; CT 942 on the
    same device, both inits and both lxc monitors survive; the memory stand-in returns."""
    etc, ct = lab
    ct(941)
    ct(942)
    lxc_lab.attach(941, HOLD)
    lxc_lab.attach(942, HOLD)
    host = ProcHost(lxc_lab.TABLE)
    before942 = set(host.ct_pids(942))
    monitors = [p for p in host.all_pids() if (i := host.describe(p)) and i.placement.place is Place.MONITOR]
    api = lxc_lab.LxcPve(etc)
    rep = reset(941, Ports(api, FdBackedProbe(host), host, SystemClock()), ResetPolicy(grace=1.0, timeout=5, restart=False))
    assert rep.outcome == "clean", rep.diagnosis
    sent = [s for s in rep.signalled if s["result"] == "sent"]
    assert {s["signal"] for s in sent} == {"SIGTERM", "SIGKILL"}  # the trap '' TERM holder needed SIGKILL
    assert all(s["cgroup"].startswith("/lxc/941/ns") and s["ns_pid"] != 1 for s in sent)
    assert api.calls == [] and lxc_lab.running(941) and lxc_lab.running(942)
    assert before942 <= set(host.ct_pids(942))  # nothing of 942 was touched
    assert all(host.describe(p) is not None for p in monitors)
    assert rep.after[0].other_holders and all(h.info.placement.vmid == 942 for h in rep.after[0].other_holders)


def test_respawning_holder_forces_verified_restart(lab):
    """A holder busybox init respawns (about 1 s later) is fought for the rounds when settle outlasts the respawn
    delay, then the CT is restarted with lxc-stop/lxc-start and the device verified free while it was stopped."""
    etc, ct = lab
    ct(943, "::respawn:/bin/sh -c 'exec 3<>/dev/nvidia0; exec sleep 1000'\n")
    host = ProcHost(lxc_lab.TABLE)
    rep = reset(943, Ports(lxc_lab.LxcPve(etc), FdBackedProbe(host), host, SystemClock()), ResetPolicy(grace=1.0, timeout=5, rounds=2, settle=2.0))
    assert any(s.name == "respawn" for s in rep.steps)
    assert rep.restarted and rep.outcome == "clean" and rep.exit_code == 0
    assert lxc_lab.running(943)


def test_dry_run_lists_holders_and_spares_init(lab):
    """--dry-run on a real CT lists its holders with container pids, marks nothing for the init, signals nothing."""
    etc, ct = lab
    ct(941)
    lxc_lab.attach(941, HOLD)
    host = ProcHost(lxc_lab.TABLE)
    pids = set(host.ct_pids(941))
    rep = reset(941, Ports(lxc_lab.LxcPve(etc), FdBackedProbe(host), host, SystemClock()), ResetPolicy(dry_run=True))
    assert rep.signalled == [] and set(host.ct_pids(941)) == pids
    planned = [p for p in rep.plan if p["action"].startswith("SIGTERM")]
    assert len(planned) == 2 and all(p["ns_pid"] not in (None, 1) for p in planned)
