"""The simulated node touches nothing real: allow-once tokens, reset locks, the guard's install and the settings
snapshot stay off this node."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from pvegpu.core.settings import GateSettings, ResetSettings
from tests.pvelike import REPO

GPU = {"minor": 0, "index": 0}


def _pvegpu(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PVEGPU_")}
    return subprocess.run([sys.executable, "-m", "pvegpu", *args], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env=clean | (env or {}))


def test_simulated_allow_once_writes_under_the_simulated_dir_never_the_real_one(sim_node):
    """`pvegpu --simulate DIR hook allow-once VMID` as a new user types it: the token is DIR/allow-once/VMID; the
    real override directory gets nothing, so the real CT of that id keeps its gate."""
    vmid = random.randint(800_000, 899_999)
    real = os.path.join(GateSettings.override_dir, str(vmid))
    node = sim_node({"node": "s", "gpus": [GPU], "containers": [{"vmid": vmid, "status": "stopped", "gpus": [0]}]})
    try:
        r = _pvegpu("--simulate", node.root, "hook", "allow-once", str(vmid))
        assert r.returncode == 0, r.stderr
        assert os.path.exists(os.path.join(node.root, "allow-once", str(vmid))) and not os.path.exists(real)
    finally:
        if os.path.exists(real):  # only if the fix is missing: never leave a real token behind
            os.unlink(real)


def test_simulated_state_dirs_default_under_the_simulated_node(tmp_path, monkeypatch):
    """Every state directory still at its real default moves under the simulated node's directory; one set explicitly stays."""
    from pvegpu import wiring

    for k in [k for k in os.environ if k.startswith("PVEGPU_")]:
        monkeypatch.delenv(k)
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    node = tmp_path / "simnode"
    node.mkdir()
    node.chmod(0o700)  # a node only its user can change (as `sim create` makes it), whatever the umask
    (node / "scenario.json").write_text("{}")
    s = wiring.settings(wiring.GlobalOptions(config=str(cfg), simulate=str(node)))
    assert s.reset.lock_dir == f"{node}/lock" and s.gate.override_dir == f"{node}/allow-once"
    assert ResetSettings.lock_dir != s.reset.lock_dir
    s = wiring.settings(wiring.GlobalOptions(config=str(cfg), simulate=str(node)), {"gate.override_dir": "/tmp/x"})
    assert s.gate.override_dir == "/tmp/x"


def test_simulate_dir_that_is_no_simulated_node_is_a_usage_error(tmp_path):
    """`--simulate DIR` on an empty or missing directory: exit 2 with a hint for every command, never an internal error."""
    for root in (str(tmp_path), str(tmp_path / "missing")):
        for args in (["audit"], ["check", "129"], ["reset", "129", "--dry-run"], ["hook", "allow-once", "129"]):
            r = _pvegpu("--simulate", root, *args)
            assert r.returncode == 2 and "Hint:" in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_each_simulated_node_has_its_own_stand_in_and_sees_no_other_holder(sim_node):
    """A sim node's GPU is its own file (not /dev/full, not another node's): a second node's workload and a host
    process holding /dev/full are no holders of it, so only its own container's process is found."""
    from pvegpu.sim.state import SimState

    ct = {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}
    a, b = (sim_node({"node": "s", "gpus": [GPU], "containers": [ct]}) for _ in range(2))
    stats = [os.stat(SimState(n.root).gpus()[0]["stand_in"]) for n in (a, b)]
    full = os.stat("/dev/full")
    keys = {(st.st_dev, st.st_ino) for st in stats}
    assert len(keys) == 2 and (full.st_dev, full.st_ino) not in keys
    assert not any(st.st_rdev == full.st_rdev for st in stats)
    other = subprocess.Popen([sys.executable, "-c", "import os,time; fd=os.open('/dev/full', os.O_RDONLY); print('ok', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline().strip() == b"ok"
        for n in (a, b):
            _pve, _nvml, host = n.ports()
            held = {p: h.minors for p, h in host.holdings(None).items() if h.minors}  # (what cannot be read is no GPU here)
            assert held and set(held) <= set(host.ct_pids(129)) and set(held.values()) == {frozenset({0})}, held
    finally:
        other.kill()
        other.wait()


def test_a_named_stand_in_is_still_accepted(sim_node):
    """Scenarios that name their stand-in (the old format) keep it: a named device is used as given."""
    from pvegpu.sim.state import SimState

    node = sim_node({"node": "s", "gpus": [GPU | {"stand_in": "/dev/full"}], "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})
    assert SimState(node.root).gpus()[0]["stand_in"] == "/dev/full"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the settings snapshot is written by root only")
def test_simulate_writes_no_settings_snapshot_into_the_real_run_pvegpu(tmp_path, monkeypatch):
    """`pvegpu --simulate DIR ...` as root with a real /etc/pvegpu/pvegpu.toml reads it but writes no snapshot to /run/pvegpu."""
    from pvegpu import wiring
    from pvegpu.adapters import settingsfile

    conf = tmp_path / "etc" / "pvegpu.toml"
    conf.parent.mkdir()
    conf.write_text("[reset]\ngrace = 5\n")
    conf.chmod(0o644)
    monkeypatch.setattr(settingsfile, "RACY_NS", 0)  # the file counts as settled (on a node it is days old)
    real_run = tmp_path / "run-pvegpu"  # stands for the node's real /run/pvegpu
    monkeypatch.setattr(settingsfile, "DEFAULT_PATH", str(conf))
    monkeypatch.setattr(settingsfile, "SNAPSHOT_DIR", str(real_run))
    monkeypatch.delenv("PVEGPU_CONFIG", raising=False)
    sim = tmp_path / "node"
    sim.mkdir()
    sim.chmod(0o700)  # a node only its user can change (as `sim create` makes it), whatever the umask
    (sim / "scenario.json").write_text("{}")
    s = wiring.settings(wiring.GlobalOptions(simulate=str(sim)))
    assert s.reset.grace == 5
    assert not real_run.exists() or not os.listdir(real_run), os.listdir(real_run)
