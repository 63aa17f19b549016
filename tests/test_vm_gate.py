"""The VM start gate: a VM's pre-start refuses while a host or container process holds a GPU its hostpciN takes,
allows an idle GPU or one bound to vfio-pci already; `pvegpu check` agrees; audit flags a GPU granted to a VM and CTs;
`hook uninstall` keeps the guard a VM's hookscript still names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pvegpu.audit.model import FlagKind
from pvegpu.audit.run import run_audit
from pvegpu.core.model import Guest
from pvegpu.gate.decide import GatePolicy, GatePorts
from pvegpu.gate.vm import evaluate_vm
from tests import pvelike
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve
from tests.test_audit import NODES, FakeFiles

PCI_CFG = "gpu0\n\tmap node=pve1,path=0000:00:00.0,id=10de:2335\n"  # FakeProbe's GPU 0 is 0000:00:00.0


def _node(conf: str, driver: str | None = "nvidia", mapping: str | None = None):
    host = FakeHost(FakeClock())
    probe, pve = FakeProbe(host, (0,)), FakePve(host)
    pve.guests_[200] = Guest(200, "pve1", "qemu")
    texts = {"nodes/pve1/qemu-server/200.conf": conf} | ({"mapping/pci.cfg": mapping} if mapping else {})
    files = FakeFiles(NODES, pve=texts, pci={} if driver is None else {"0000:00:00.0": (driver, "0x10de")})
    return host, probe, pve, files


def _check(host, probe, pve, files, policy=GatePolicy()):
    return evaluate_vm(200, Guest(200, "pve1", "qemu"), GatePorts(pve, probe, host), files, policy)


def test_idle_gpu_on_nvidia_is_allowed():
    """A GPU still on the nvidia driver that no process holds: the VM may start."""
    chk = _check(*_node("hostpci0: 0000:00:00.0,pcie=1\n"))
    assert chk.allow and chk.devices[0]["state"] == "clean"


def test_container_holder_refuses_and_names_it_with_the_fix():
    """A CT process holding the GPU (matched by bus id through a mapping=) refuses, naming pid, CT and `pvegpu reset`."""
    host, probe, pve, files = _node("hostpci0: mapping=gpu0\n", mapping=PCI_CFG)
    p = host.add(129, minors={0})
    probe.context(0, 1024, p)
    chk = _check(host, probe, pve, files)
    assert not chk.allow and chk.devices[0]["state"] == "refused" and chk.devices[0]["holders"] == [p.pid]
    assert f"pid {p.pid}" in chk.text() and "CT 129" in chk.text() and any("pvegpu reset 129" in f for f in chk.fix)


def test_host_fd_holder_without_memory_refuses():
    """An fd-only holder on the host (an NVML client such as persistenced) keeps the device open: the unbind would block."""
    host, probe, pve, files = _node("hostpci0: 00:00\n")
    host.add(None, minors={0}, comm="nvidia-persiste", maps=False)
    chk = _check(host, probe, pve, files)
    assert not chk.allow and any("-pm 0" in f for f in chk.fix)


def test_vfio_bound_gpu_is_allowed_without_reading_nvml():
    """Bound to vfio-pci already: nobody on the host can use it; allowed even when NVML is unreadable."""
    host, probe, pve, files = _node("hostpci0: 0000:00:00.0\n", driver="vfio-pci")
    probe.fail.add(0)
    chk = _check(host, probe, pve, files)
    assert chk.allow and chk.devices[0]["state"] == "vfio"


def test_unreadable_gpu_fails_closed_unless_allowed():
    """On nvidia but unreadable: refused (unknown is never idle); gate.on_unknown = allow lets it through."""
    node = _node("hostpci0: 0000:00:00.0\n")
    node[1].fail.add(0)
    assert not _check(*node).allow
    assert _check(*node, policy=GatePolicy(on_unknown="allow")).allow


def test_leftover_memory_with_no_holder_refuses():
    """Memory held on the GPU with no process holding it (a driver leak) refuses."""
    host, probe, pve, files = _node("hostpci0: 0000:00:00.0\n")
    probe.leak[0] = 2048 * 1024 * 1024
    chk = _check(host, probe, pve, files)
    assert not chk.allow and "pvegpu gpu-reset" in chk.text()


def test_keep_and_mdev_and_absent_devices_are_not_judged():
    """driver=keep / a vGPU stays on the host driver, a device absent here is PVE's own error: allowed with a remark."""
    host, probe, pve, files = _node("hostpci0: 0000:00:00.0,driver=keep\nhostpci1: 0000:07:00.0\n")
    p = host.add(129, minors={0})
    probe.context(0, 1024, p)
    chk = _check(host, probe, pve, files)
    assert chk.allow and [d["state"] for d in chk.devices] == ["kept", "absent"]


def test_audit_flags_a_gpu_granted_to_a_vm_and_to_containers():
    """A GPU named by a VM's hostpci and by a CT's devN is a vm-and-container finding (needs attention)."""
    host, probe, pve, files = _node("hostpci0: 0000:00:00.0\n")
    pve.add_ct(129, (0,))
    rep = run_audit(pve=pve, probe=probe, host=host, files=files)
    kinds = [f.kind for f in rep.flags]
    assert FlagKind.VM_AND_CT in kinds and rep.attention and FlagKind.VM_AND_CT.attention


# -- through the hookscript and `pvegpu check`, on the simulated node ------------------------------------------


# a stand-in device no other test on this machine holds (other suites' workloads hold /dev/full, and the VM gate's
# whole-host scan would rightly see them as host holders of "GPU 0"): this module's own pseudo-terminal, which a user
# can open too (its master stays open while the module lives)
_PTY_MASTER, _pty_slave = pvelike.high_pty()
STAND_IN = os.ttyname(_pty_slave)
os.close(_pty_slave)


SLOW_OK = {"PVEGPU_GATE_DEADLINE": "25"}  # a loaded CI machine: the whole-node scan must not hit the 5 s deadline here


def _scenario(driver: str = "nvidia", workloads=()):
    return {"node": "pve-sim", "gpus": [{"minor": 0, "index": 0, "stand_in": STAND_IN}],
            "containers": [{"vmid": 129, "status": "running", "gpus": [0], "workloads": list(workloads)}],
            "vms": [{"vmid": 200, "config": "name: vm200\nhostpci0: 0000:41:00,pcie=1\nhookscript: local:snippets/pvegpu-guard\n"}],
            "pci": {"0000:41:00.0": driver}}


@pytest.fixture
def guard(tmp_path):
    return pvelike.guard(str(tmp_path), pvelike.launcher(str(tmp_path)))


def test_vm_start_refused_while_a_container_holds_its_gpu(sim_node, guard):
    """pre-start of VM 200 exits 10 with the holder named on stderr (the task log) while CT 129 holds the GPU."""
    node = sim_node(_scenario(workloads=[{"kind": "simple", "gpu": 0, "mib": 1024}]))
    r = pvelike.run_as_pve(guard, 200, "pre-start", {"PVEGPU_SIMULATE": node.root, **SLOW_OK})
    assert r.returncode == 10, r.stderr
    assert "refusing to start VM 200" in r.stderr and "CT 129" in r.stderr and "pvegpu reset 129" in r.stderr


def test_vm_start_allowed_when_idle_and_check_agrees(sim_node, guard):
    """An idle GPU: pre-start exits 0; `pvegpu check 200 --json` says allow with the device's state."""
    node = sim_node(_scenario())
    r = pvelike.run_as_pve(guard, 200, "pre-start", {"PVEGPU_SIMULATE": node.root, **SLOW_OK})
    assert r.returncode == 0 and "VM 200 may start" in r.stdout
    c = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "check", "200", "--json"],
                       capture_output=True, text=True, timeout=90, cwd=pvelike.REPO, env=os.environ | SLOW_OK)
    doc = json.loads(c.stdout)
    assert c.returncode == 0 and doc["allow"] and doc["devices"][0]["state"] == "clean"


def test_check_refuses_like_the_hook_and_vfio_allows(sim_node):
    """`pvegpu check 200` exits 10 while CT 129 holds the GPU; the same GPU bound to vfio-pci is allowed (exit 0)."""
    busy = sim_node(_scenario(workloads=[{"kind": "simple", "gpu": 0, "mib": 1024}]))
    c = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", busy.root, "check", "200"], capture_output=True, text=True,
                       timeout=90, cwd=pvelike.REPO, env=os.environ | SLOW_OK)
    assert c.returncode == 10 and "refusing to start VM 200" in c.stdout
    vfio = sim_node(_scenario(driver="vfio-pci"))
    c = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", vfio.root, "check", "200"], capture_output=True, text=True,
                       timeout=90, cwd=pvelike.REPO, env=os.environ | SLOW_OK)
    assert c.returncode == 0, c.stdout + c.stderr


def test_vm_post_stop_exits_zero_quietly(sim_node, guard):
    """post-stop of a VM never fails and reports nothing about containers."""
    node = sim_node(_scenario(workloads=[{"kind": "simple", "gpu": 0, "mib": 1024}]))
    r = pvelike.run_as_pve(guard, 200, "post-stop", {"PVEGPU_SIMULATE": node.root, **SLOW_OK})
    assert r.returncode == 0 and "CT 200" not in r.stdout + r.stderr


def test_vm_gate_path_imports_no_heavy_library(tmp_path):
    """`pvegpu hook 200 pre-start` for a VM on a PVE-like node, run as the guard's fast path runs it, imports none of
    the heavy libraries."""
    from pvegpu.cli.install import fast_path
    from tests.test_structure import HEAVY

    root = pvelike.etc_pve(str(tmp_path / "pve"), "n1", {}, vms=(200,))
    (tmp_path / "pve" / "nodes" / "n1" / "qemu-server" / "200.conf").write_text("hostpci0: 0000:41:00.0\n")
    code = ("import sys, json; from pvegpu.cli import run; rc = run(sys.argv[1:]); "
            "print(json.dumps([rc, sorted(m for m in sys.modules)]), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {fast_path()!r}.split(':'); " + code,
                        "hook", "200", "pre-start"], capture_output=True, text=True, timeout=60,
                       env={"PATH": pvelike.PVE_PATH, "LC_ALL": "C", "PVEGPU_PVE_ROOT": root, "PVEGPU_RESET_LOCK_DIR": str(tmp_path / "lock")})
    rc, loaded = json.loads(r.stderr.strip().splitlines()[-1])
    assert rc in (0, 10), r.stderr
    assert not [m for m in loaded if m.split(".")[0] in HEAVY] and "pvegpu.cli.app" not in loaded


def test_allow_once_lets_one_vm_start_through(sim_node, guard, tmp_path):
    """`pvegpu hook allow-once 200` for a VM: its next pre-start passes (saying what it would have refused), the one after refuses."""
    node = sim_node(_scenario(workloads=[{"kind": "simple", "gpu": 0, "mib": 1024}]))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[gate]\noverride_dir = "{tmp_path}/once"\n')
    cfg.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    env = {"PVEGPU_SIMULATE": node.root, "PVEGPU_CONFIG": str(cfg), **SLOW_OK}
    a = subprocess.run([sys.executable, "-m", "pvegpu", "--simulate", node.root, "--config", str(cfg), "hook", "allow-once", "200"],
                       capture_output=True, text=True, timeout=90, cwd=pvelike.REPO, env=os.environ | SLOW_OK)
    assert a.returncode == 0 and "VM 200" in a.stdout, a.stderr
    first = pvelike.run_as_pve(guard, 200, "pre-start", env)
    assert first.returncode == 0 and "VM 200 allowed to start ONCE" in first.stdout and "CT 129" in first.stdout
    assert pvelike.run_as_pve(guard, 200, "pre-start", env).returncode == 10


def test_hook_uninstall_keeps_the_guard_a_vm_hookscript_still_runs(tmp_path):
    """`hook uninstall` of the last guarded container keeps the guard snippet while a VM's hookscript still names it."""
    from pvegpu.cli import install as ins
    from tests.pvelike import etc_pve

    pve = etc_pve(str(tmp_path / "pve"), "pve1", {129: "arch: amd64\ndev0: /dev/nvidia0\nhookscript: local:snippets/pvegpu-guard\n"},
                  vms=(200,))
    with open(os.path.join(pve, "nodes", "pve1", "qemu-server", "200.conf"), "w") as f:
        f.write("hostpci0: 0000:01:00.0\nhookscript: local:snippets/pvegpu-guard\n")
    vz = tmp_path / "vz"
    (vz / "snippets").mkdir(parents=True)
    (vz / "snippets" / "pvegpu-guard").write_text(ins.guard_text(ins.template()))
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent snippets\n")

    def run(argv):  # `pct set 129 --delete hookscript`
        conf = os.path.join(pve, "nodes", "pve1", "lxc", f"{argv[2]}.conf")
        text = open(conf).read()
        open(conf, "w").write("".join(ln for ln in text.splitlines(True) if not ln.startswith("hookscript:")))
        return 0, ""

    plan = ins.uninstall([129], pve_root=pve, node="pve1", run=run)
    assert plan.ok
    assert (vz / "snippets" / "pvegpu-guard").exists(), plan.done
