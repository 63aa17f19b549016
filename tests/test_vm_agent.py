"""VM reset against fakepve's agent endpoints with scripted guest answers (no qemu-ga needed): the API shapes and
faults: a Windows guest, no agent configured, an agent that hangs, a lock, HA, a reboot verified in the guest,
hostile guest output, a VM stopped by its admin or paused, a 403 on agent/exec (none of them rebooted), signals
during the reboot, and the parsing of what a guest prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from fakepve import agent as fake_agent
from fakepve.model import PveError

from pvegpu.vm.guest import KILL_SCRIPT, NVSMI_APPS, NVSMI_GPUS, SCAN_SCRIPT, parse_apps, parse_scan
from tests.pvelike import REPO
from tests.test_faults import cli, write_config

VMID = 200
FAST = {"grace": 0.2, "kill_wait": 0.3, "timeout": 0.6, "settle": 0.1, "task_timeout": 3, "lock_wait": 1}


def scripted(dirty_until_restart: bool = True, smi_err: str | None = None):
    """fakepve agent answers: pid 4242 holds the GPU until the VM is started again (or always/never)."""
    def result(vm, command, values):
        if command == "ping":
            return {"result": {}}
        if command == "exec":
            vm.agent_pid += 1
            vm.agent_execs[vm.agent_pid] = list(values["command"])
            return {"pid": vm.agent_pid}
        if command != "exec-status":
            return {"result": None}
        argv = vm.agent_execs[int(values["pid"])]
        dirty = dirty_until_restart and vm.started_at == vm.first_start
        if tuple(argv) == NVSMI_APPS:
            if smi_err is not None:
                return {"exited": 1, "exitcode": 9, "err-data": smi_err}
            return {"exited": 1, "exitcode": 0, "out-data": "4242, 1024\n" if dirty else ""}
        if tuple(argv) == NVSMI_GPUS:
            return {"exited": 1, "exitcode": 0, "out-data": f"0, 00000000:01:00.0, {1024 if dirty else 0}\n"}
        if argv[:3] == ["sh", "-c", SCAN_SCRIPT]:
            return {"exited": 1, "exitcode": 0, "out-data": ("holder 4242 777 fd,maps python3\n" if dirty else "") + "scan-done\n"}
        if argv[:3] == ["sh", "-c", KILL_SCRIPT]:
            return {"exited": 1, "exitcode": 0, "out-data": "sent 4242\nkill-done\n"}
        return {"exited": 1, "exitcode": 127, "err-data": "unexpected"}
    return result


@pytest.fixture
def api(fakepve, fakepve_cafile, tmp_path, monkeypatch):
    fakepve.apitokens["root@pam!pvegpu"] = "a1b2"
    host, port = fakepve.url.split("//")[1].split(":")
    tok = tmp_path / "token"
    tok.write_text("a1b2\n")
    tok.chmod(0o600)

    def add(conf=None, answers=None, **kw):
        v = fakepve.add_vm(VMID, "gpu200", node="pve1", status=kw.pop("status", "running"),
                           config={"hostpci0": "mapping=gpu,pcie=1", "agent": "enabled=1", "ostype": "l26"} | (conf or {}))
        for k, val in kw.items():
            setattr(v, k, val)
        v.agent = {}
        v.first_start = v.started_at
        monkeypatch.setattr(fake_agent, "result", answers or scripted())
        return v

    def config(**reset):
        a = dict(backend="https", host=host, port=int(port), token_name="pvegpu", token_file=str(tok), verify=fakepve_cafile, timeout=5)
        return write_config(tmp_path / "pvegpu.toml", top={"node": "pve1", "pve_root": str(tmp_path / "no-etc-pve")}, api=a,
                            reset=FAST | {"lock_dir": str(tmp_path / "lock")} | reset)

    return fakepve, add, config


def run(config, *args):
    return cli(["reset", str(VMID), "--json", *args], config=config, module="pvegpu", bound=30)


def test_reboot_verified_in_the_guest(api):
    """A holder SIGKILL cannot end (it stays until the VM restarts): shutdown, start, verified clean in the guest: exit 0."""
    fake, add, config = api
    v = add()
    r = run(config())
    assert r.rc == 0 and r.report["restarted"] and r.report["outcome"] == "clean" and v.status == "running", r.err + r.out
    assert [s["outcome"] for s in r.report["steps"] if s["name"] == "restart"] == ["shutdown", "start", "started"]


def test_ha_managed_vm_reboot_is_followed_to_its_state(api):
    """An HA-managed VM: the tasks only request the state; pvegpu follows the VM to stopped and running, then verifies."""
    fake, add, config = api
    v = add(ha_state="started")
    r = run(config())
    assert r.rc == 0 and r.report["restarted"] and v.status == "running", r.err + r.out


def test_locked_vm_is_not_rebooted(api):
    """A lock: (backup) refuses the reboot with the lock named: exit 4; the VM keeps running."""
    fake, add, config = api
    v = add(lock="backup")
    r = run(config())
    assert r.rc == 4 and any("locked (backup)" in d["problem"] for d in r.report["diagnosis"]) and v.status == "running"


def test_windows_guest(api):
    """ostype win*: one line saying Windows guests are not looked into, exit 5 with --no-restart; nothing is run in the guest."""
    fake, add, config = api
    v = add({"ostype": "win11"})
    r = run(config(), "--no-restart")
    assert r.rc == 5 and any("Windows" in d["problem"] for d in r.report["diagnosis"]) and not v.agent_requests


def test_no_agent_configured_reboots_and_says_it_is_unverified(api):
    """No `agent:` in the config: exit 4 with --no-restart; allowed to reboot, the VM is rebooted and reported not verified."""
    fake, add, config = api
    v = add({"agent": "0"})
    r = run(config(), "--no-restart")
    assert r.rc == 4 and any("no guest agent configured" in d["problem"] for d in r.report["diagnosis"]), r.err + r.out
    r = run(config())
    assert r.rc == 4 and r.report["restarted"] and r.report["outcome"] == "not verified" and v.status == "running"


def test_agent_that_hangs_is_a_clear_error(api):
    """The agent is configured but does not answer (PVE's qmp timeout): exit 4 naming the agent, not a traceback."""
    fake, add, config = api
    add(agent_hangs=True)
    r = run(config(), "--no-restart")
    assert r.rc == 4 and any("does not answer" in d["problem"] for d in r.report["diagnosis"])


def test_stopped_vm_and_vm_without_gpu_and_unknown_vm(api):
    """A stopped VM: nothing to do (exit 0, not running); a VM without hostpci: exit 3; an unknown id: exit 3."""
    fake, add, config = api
    add(status="stopped")
    r = run(config())
    assert r.rc == 0 and r.report["outcome"] == "not running"
    fake.vms[0].config.pop("hostpci0")
    assert run(config()).rc == 3
    r = cli(["reset", "4321"], config=config(), module="pvegpu", bound=30)
    assert r.rc == 3 and "no guest 4321" in r.err


def test_guest_output_is_escaped(api):
    """nvidia-smi's error text from the guest with terminal escapes comes out escaped (\\x1b), never raw."""
    fake, add, config = api
    add(answers=scripted(smi_err="\x1b[2J\x1b]0;owned\x07boom"))
    r = cli(["reset", str(VMID), "--no-restart"], config=config(), module="pvegpu", bound=30)
    assert r.rc == 5 and "\x1b" not in r.out + r.err and "\\x1b" in r.out


# -- a VM stopped by its admin, a 403, a paused VM: no reboot ---------------------------------------------------


def test_cli_vm_stopped_by_its_admin_mid_reset_is_left_stopped(api):
    """Through fakepve: the VM is stopped during pvegpu's first exec: exit 0 'not running', the VM stays stopped."""
    fake, add, config = api
    inner = scripted()

    def answers(vm, command, values):
        if command == "exec" and vm.status == "running" and vm.started_at == vm.first_start:
            vm.status = vm.qmpstatus = "stopped"
            raise PveError(500, "VM 200 not running")
        return inner(vm, command, values)

    v = add(answers=answers)
    r = run(config())
    assert r.rc == 0 and r.report["outcome"] == "not running" and v.status == "stopped", (r.rc, r.report["steps"])
    assert not [s for s in r.report["steps"] if s["name"] == "restart"]


def test_cli_forbidden_exec_does_not_reboot_the_vm(api):
    """fakepve answers agent/exec with PVE's 403: exit 4, no restart step, the VM is not rebooted."""
    fake, add, config = api
    inner = scripted()

    def answers(vm, command, values):
        if command == "exec":
            raise PveError(403, "Permission check failed (/vms/200, VM.GuestAgent.Unrestricted)")
        return inner(vm, command, values)

    v = add(answers=answers)
    r = run(config())
    assert r.rc == 4 and not [s for s in r.report["steps"] if s["name"] == "restart"], (r.rc, r.report["steps"])
    assert v.started_at == v.first_start and v.status == "running"


def test_cli_paused_vm_is_not_stopped(api):
    """Through fakepve: a paused VM whose agent hangs: exit 4 at once, no restart step, the VM stays paused."""
    fake, add, config = api
    v = add(qmpstatus="paused", agent_hangs=True)
    r = run(config())
    assert r.rc == 4 and not [s for s in r.report["steps"] if s["name"] == "restart"], (r.rc, r.report["steps"])
    assert v.qmpstatus == "paused" and r.wall < 10


# -- signals as for a container ---------------------------------------------------------------------------


def _reset_signalled(config, sends):
    """Run `pvegpu reset 200` (human output); ``sends``: (line fragment, signal) pairs, each sent once its line shows."""
    p = subprocess.Popen([sys.executable, "-m", "pvegpu", "--config", config, "reset", "200"], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen, todo = [], list(sends)
    assert p.stdout is not None
    for line in p.stdout:
        seen.append(line)
        if todo and todo[0][0] in line:
            time.sleep(0.1)
            p.send_signal(todo.pop(0)[1])
            if not todo:
                break
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return p.returncode, "".join(seen) + out, err


def test_cli_sigint_during_the_reboot_finishes_it_and_exits_130(api):
    """SIGINT after the shutdown request: the reboot is finished, the report says interrupted, exit 130, the VM runs."""
    fake, add, config = api
    v = add(shutdown_secs=0.5, start_secs=1)
    rc, out, err = _reset_signalled(config(), [("shutting VM 200 down", signal.SIGINT)])
    assert rc == 130 and "[interrupted]" in out and v.status == "running", (rc, out[-800:], err[-800:])


def test_cli_second_signal_abandons_the_reboot(api):
    """A second signal (during the start) abandons the reboot: exit 130 and the report still comes, naming where the VM is."""
    fake, add, config = api
    add(shutdown_secs=0.5, start_secs=3)
    rc, out, err = _reset_signalled(config(), [("shutting VM 200 down", signal.SIGINT), ("starting it", signal.SIGINT)])
    assert rc == 130 and "[interrupted]" in out and "VM 200:" in out, (rc, out[-800:], err[-800:])


def test_cli_sigterm_before_any_power_action_leaves_the_vm_running(api):
    """SIGTERM while pvegpu still works inside the guest: exit 143 at once, the VM never shut down."""
    fake, add, config = api
    v = add()
    rc, out, err = _reset_signalled(config(grace=5), [("SIGTERM →", signal.SIGTERM)])
    assert rc == 143 and "[restart]" not in out and v.status == "running" and v.started_at == v.first_start, (rc, out, err)


def test_parsing_refuses_forged_lines():
    """Only exact lines count: a name cannot add a holder, junk pids are ignored, and a scan without its end marker is incomplete."""
    found, complete = parse_scan("holder 12 345 fd,maps py\nholder 13 x fd py\nholder 14 1 fd,maps a b\nfoo\n")
    assert list(found) == [12] and not complete
    assert parse_apps("12, 100\n13, [N/A]\n-1, 5\nx, 1\n") == [(12, 100), (13, None)]


def test_pvesh_passes_an_argv_as_one_option_per_item():
    """The local backend turns agent/exec's command array into repeated -command=ITEM options (an item may start with '-')."""
    from pvegpu.adapters.pvesh import _options

    assert _options({"command": list(NVSMI_APPS)}, None) == [f"-command={a}" for a in NVSMI_APPS]
    assert _options({"timeout": 60}, None) == ["-timeout", "60"]


def test_verbose_logs_every_step_as_json_lines(api):
    """-v with --json: every step of a VM reset is also a JSON event line on stderr (reset.signal among them)."""
    import json as _json

    fake, add, config = api
    add()
    r = cli(["reset", str(VMID), "--json", "-v", "--no-restart"], config=config(), module="pvegpu", bound=30)
    events = [_json.loads(line) for line in r.err.splitlines() if line.startswith("{")]
    assert r.rc == 6 and any(e.get("event") == "reset.signal" and e.get("type") == "qemu" for e in events), r.err
