"""Operations: the systemd units (audit timer, device nodes before pve-guests) and the audit while the driver is not ready at boot."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys

import pytest

from pvegpu.core.errors import EXIT_AUDIT_ATTENTION
from pvegpu.sim.state import SimState
from tests.pvelike import REPO

UNITS = os.path.join(REPO, "contrib", "systemd")


def unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read(os.path.join(UNITS, name))
    return cp


def test_device_nodes_unit_runs_before_guests_start():
    """pvegpu-nvidia-nodes.service is a oneshot ordered Before=pve-guests.service, pulled in by it, with a deadline."""
    u = unit("pvegpu-nvidia-nodes.service")
    assert "pve-guests.service" in u["Unit"]["Before"].split() and u["Service"]["Type"] == "oneshot"
    assert "pve-guests.service" in u["Install"]["WantedBy"].split() and u["Service"]["RemainAfterExit"] == "yes"
    assert int(u["Service"]["TimeoutStartSec"]) > 0


def test_audit_timer_writes_the_textfile_every_minute_and_exit_8_is_not_a_failure():
    """The timer fires every minute; the service writes the .prom textfile, treats exit 8 (attention) as success, has a deadline."""
    t, s = unit("pvegpu-audit.timer"), unit("pvegpu-audit.service")
    assert t["Timer"]["OnUnitActiveSec"] == "1min" and t["Install"]["WantedBy"] == "timers.target"
    assert "--prometheus" in s["Service"]["ExecStart"] and s["Service"]["ExecStart"].endswith(".prom")
    assert s["Service"]["SuccessExitStatus"] == str(EXIT_AUDIT_ATTENTION) and int(s["Service"]["TimeoutStartSec"]) < 60


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_units_pass_systemd_analyze_verify(tmp_path):
    """systemd's own checker finds no syntax error in the shipped units (missing binaries on this machine are not syntax)."""
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *(os.path.join(UNITS, n) for n in sorted(os.listdir(UNITS)))],
                       capture_output=True, text=True, timeout=60)
    bad = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("Unknown key", "Unknown section", "Failed to parse", "bad-setting"))]
    assert bad == [], r.stderr


def pvegpu(*args, root):
    return subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", root, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_driver_not_ready_at_boot_is_reported_then_clears(sim_node):
    """Driver not loaded: NVML error row (not 0 GPUs), the onboot container's missing nodes flagged with the unit to install, exit 8; once ready: clean."""
    gpu = {"minor": 0, "index": 0, "driver_ready": False}
    n = sim_node({"node": "s", "gpus": [gpu], "containers": [{"vmid": 129, "gpus": [0], "status": "stopped"}]})
    r = pvegpu("audit", "--json", root=n.root)
    assert r.returncode == EXIT_AUDIT_ATTENTION and "Traceback" not in r.stderr, r.stderr
    node = json.loads(r.stdout)["nodes"][0]
    assert node["ok"] is False and "Driver Not Loaded" in node["error"] and node["gpus"] == []
    (missing,) = [f for f in node["flags"] if f["kind"] == "missing-device-node"]
    assert missing["subject"] == "lxc/129" and "/dev/nvidia0" in missing["detail"] and "pvegpu-nvidia-nodes.service" in missing["advice"]
    assert os.path.exists(os.path.join(UNITS, "pvegpu-nvidia-nodes.service"))
    SimState(n.root).set_gpus([gpu | {"driver_ready": True}])
    node = json.loads(pvegpu("audit", "--json", root=n.root).stdout)["nodes"][0]
    assert node["ok"] is True and [g["minor"] for g in node["gpus"]] == [0]
    assert not [f for f in node["flags"] if f["kind"] in ("missing-device-node", "unreadable-gpu")]
