"""`pvegpu reset VMID` for a VM, through the real command line against fakepve over HTTPS with a token, whose
agent/exec and agent/exec-status go to a real qemu-ga in a PID+mount namespace (tests/vm_guest.py): holders found
and stopped in the guest, the agent dying mid-way, an exec timing out, no nvidia-smi, the reboot path failing."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
from fakepve import agent as fake_agent

from tests.test_faults import cli, write_config
from tests.vm_guest import QEMU_GA, Guest, forwarder

pytestmark = [pytest.mark.root,  # under REQUIRE_ROOT_TESTS=1 a skip is a failure (tests/conftest.py)
              pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(QEMU_GA) or not shutil.which("unshare"),
                                 reason="needs root, unshare and qemu-ga (apt-get install qemu-guest-agent)")]

FAST = {"grace": 0.5, "kill_wait": 1.0, "timeout": 4.0, "settle": 0.1, "task_timeout": 5, "lock_wait": 1}
VMID = 200
CONF = {"hostpci0": "0000:41:00.0,pcie=1", "agent": "1", "ostype": "l26"}


@pytest.fixture
def vm(fakepve, fakepve_cafile, tmp_path, monkeypatch, request):
    """fakepve with VM 200 running on pve1 (agent on), its agent a real qemu-ga "guest"; config(**reset) writes settings."""
    fakepve.apitokens["root@pam!pvegpu"] = "a1b2"
    v = fakepve.add_vm(VMID, "gpu200", node="pve1", status="running", config=dict(CONF))
    v.agent = {}
    guest = Guest(str(tmp_path / "guest"))
    request.addfinalizer(guest.stop)  # even when the rest of the set-up fails
    monkeypatch.setattr(fake_agent, "result", forwarder(guest, VMID, fake_agent.result))
    host, port = fakepve.url.split("//")[1].split(":")
    tok = tmp_path / "token"
    tok.write_text("a1b2\n")
    tok.chmod(0o600)

    def config(**reset):
        api = dict(backend="https", host=host, port=int(port), token_name="pvegpu", token_file=str(tok), verify=fakepve_cafile, timeout=5)
        return write_config(tmp_path / "pvegpu.toml", top={"node": "pve1", "pve_root": str(tmp_path / "no-etc-pve")}, api=api,
                            reset=FAST | {"lock_dir": str(tmp_path / "lock")} | reset)

    return fakepve, v, guest, config


def reset(config, *args, bound=40.0):
    return cli(["reset", str(VMID), "--json", *args], config=config, module="pvegpu", bound=bound)


def test_holders_in_the_guest_found_stopped_and_verified(vm):
    """Two holders (one ignores SIGTERM): SIGTERM, then SIGKILL; verified clean by the guest's nvidia-smi; exit 0; the guest's init untouched."""
    fake, v, guest, config = vm
    a, b = guest.holder(), guest.holder("ignore-term")
    r = reset(config())
    rep = r.report
    assert r.rc == 0, r.err + r.out
    assert rep["outcome"] == "clean" and rep["evidence"] == "guest" and not rep["restarted"]
    assert {h["pid"] for h in rep["before"]["holders"]} == {a, b} and rep["after"]["holders"] == []
    sig = {(s["pid"], s["signal"]) for s in rep["signalled"]}
    assert {(a, "SIGTERM"), (b, "SIGTERM"), (b, "SIGKILL")} <= sig and (a, "SIGKILL") not in sig
    assert all(s["pid"] != 1 for s in rep["signalled"]) and guest.mappers() == []
    assert r.wall < 20


def test_dry_run_signals_nothing(vm):
    """--dry-run lists the guest's holders and signals none: they still hold the device."""
    fake, v, guest, config = vm
    a = guest.holder()
    r = reset(config(), "--dry-run")
    assert r.rc == 0 and r.report["outcome"] == "dry-run" and [p["pid"] for p in r.report["plan"]] == [a]
    assert r.report["signalled"] == [] and guest.mappers() == [a]


def test_human_output_says_the_evidence_is_the_guests(vm):
    """Without --json: steps as they happen, and the verdict names the guest as the evidence."""
    fake, v, guest, config = vm
    guest.holder()
    r = cli(["reset", str(VMID)], config=config(), module="pvegpu", bound=40)
    assert r.rc == 0 and "[signal] SIGTERM" in r.out and "verified free in the guest" in r.out


def test_agent_stopped_mid_way(vm):
    """The agent dies right after the SIGTERM was sent: one line naming the agent, exit 4, within the bound."""
    fake, v, guest, config = vm
    guest.holder("ignore-term")
    done = threading.Event()

    def watch():
        while not done.wait(0.01):
            if any("pvegpu-kill" in str(req[1].get("command")) for req in list(v.agent_requests)):
                guest.stop_agent()
                return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        r = reset(config(grace=3.0), "--no-restart")
    finally:
        done.set()
        t.join(5)
    assert r.rc == 4 and r.report["outcome"] == "not verified", r.err + r.out
    assert any("guest agent of VM 200 does not answer" in d["problem"] for d in r.report["diagnosis"])
    assert r.wall < 20


def test_exec_timing_out(vm):
    """nvidia-smi hangs in the guest: the exec is given up after its deadline, exit 4, named as a timeout."""
    fake, v, guest, config = vm
    open(os.path.join(guest.bin, "hang"), "w").close()
    t0 = time.monotonic()
    r = reset(config(), "--no-restart")
    assert r.rc == 4 and any("did not finish within" in d["problem"] for d in r.report["diagnosis"]), r.err + r.out
    assert time.monotonic() - t0 < 20


def test_guest_without_nvidia_smi(vm):
    """No nvidia-smi on the agent's PATH: exit 5 with --no-restart; with the reboot allowed the VM is rebooted
    through the API, still cannot be verified: exit 5, restarted, running."""
    fake, v, guest, config = vm
    os.unlink(os.path.join(guest.bin, "nvidia-smi"))
    r = reset(config(), "--no-restart")
    assert r.rc == 5 and any("no nvidia-smi" in d["problem"] for d in r.report["diagnosis"]), r.err + r.out
    r = reset(config())
    assert r.rc == 5 and r.report["restarted"] and r.report["outcome"] == "not verified" and v.status == "running", r.err + r.out


def test_reboot_path_with_a_failing_task(vm):
    """A supervisor respawns the holder: not clean, so the VM is shut down (ignored: no ACPI, the task fails), stopped,
    and its start task fails: exit 4, the task's log, the VM left STOPPED and said so."""
    fake, v, guest, config = vm
    guest.respawner()
    v.acpi = False
    v.start_error = "start failed: a PCI device is busy"
    r = reset(config())
    rep = r.report
    assert r.rc == 4, r.err + r.out
    assert rep["left_stopped"] and rep["vm_state"] == "stopped" and v.status == "stopped"
    assert any("start" in d["problem"] for d in rep["diagnosis"]) and rep["task_log"]
    assert r.wall < 40


def test_holders_left_without_restart_exit_6(vm):
    """A respawning holder with --no-restart: not clean, exit 6, the holders named; the VM is not touched."""
    fake, v, guest, config = vm
    guest.respawner()
    r = reset(config(), "--no-restart")
    assert r.rc == 6 and r.report["outcome"] == "not clean" and v.status == "running", r.err + r.out


def test_only_fixed_commands_reach_the_guest(vm):
    """Every command sent to the guest is a fixed argv: nvidia-smi with fixed options, or sh -c with pvegpu's own
    script and integers; a holder's name never appears in a command."""
    from pvegpu.vm.guest import KILL_SCRIPT, NVSMI_APPS, NVSMI_GPUS, SCAN_SCRIPT

    fake, v, guest, config = vm
    guest.holder("ignore-term")
    assert reset(config()).rc == 0
    execs = [list(req[1]["command"]) for req in v.agent_requests if req[0] == "exec"]
    assert execs
    for argv in execs:
        if argv[0] == "nvidia-smi":
            assert tuple(argv) in (NVSMI_APPS, NVSMI_GPUS)
        elif argv[:2] == ["sh", "-c"]:
            assert argv[2] in (SCAN_SCRIPT, KILL_SCRIPT)
            assert argv[3] in ("pvegpu-scan", "pvegpu-kill")
            assert all(a.isdigit() for a in argv[5:]) and (argv[3] == "pvegpu-scan" or argv[4] in ("TERM", "KILL"))
        else:
            raise AssertionError(argv)
