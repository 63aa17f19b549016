"""A VM reset reads every remote answer as a claim to check: an exec-status that does not decode or has no
``exited``, a status about another guest, output the agent cut, a view from before the signals, HA that will
not act. Each is named (exit 4) or judged on a fresh look, and none is a reason for a power action.

Items 1-3 go through the real adapters (proxmoxer over HTTPS, answers scripted with ``responses``); items 4-5
through the in-process fake VmApi of tests/vm_fakes.py; all on a fake clock."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import pytest
import responses
from proxmoxer import ProxmoxAPI

from pvegpu.adapters.agent import ProxmoxerVm
from pvegpu.adapters.pve import ProxmoxerPve
from pvegpu.core import errors as E
from pvegpu.core.model import Guest
from pvegpu.testing import FakeClock
from pvegpu.vm.guest import KILL_SCRIPT, MAX_LINES, NVSMI_APPS, NVSMI_GPUS, SCAN_SCRIPT
from pvegpu.vm.reset import REBOOTABLE, VmOutcome, VmPolicy, VmReport, reset_vm
from tests import test_pve_adapter as adapter_tests
from tests.vm_fakes import FakeVm

BASE = "https://pve.test:8006/api2/json"
VM = f"{BASE}/nodes/pve1/qemu/200"
POWER = ("shutdown", "stop", "start")
FAST = {"grace": 0.2, "kill_wait": 0.2, "timeout": 0.5, "settle": 0.1, "exec_timeout": 1.0, "task_timeout": 2.0, "state_wait": 1.0}

Answer = tuple[int, dict[str, str], str | bytes]
pvesh = adapter_tests.pvesh  # the fixture: a stand-in pvesh first on PATH


def _json(data: Any) -> Answer:
    return 200, {"Content-Type": "application/json"}, json.dumps({"data": data})


class Remote:
    """VM 200 on pve1 behind proxmoxer over HTTPS, every answer scripted. Its guest shows pid 4242 holding the GPU until
    it is signalled; ``exec_status`` (argv -> an answer, or None for the guest's own) and ``status`` replace answers."""

    def __init__(self, rsps: responses.RequestsMock) -> None:
        self.execs: dict[int, list[str]] = {}
        self.calls: list[str] = []
        self.alive = True
        self.status: dict[str, Any] = {"vmid": 200, "status": "running", "qmpstatus": "running", "ha": {"managed": 0}}
        self.exec_status: Callable[[list[str]], Answer | None] = lambda argv: None
        rsps.add(responses.GET, f"{BASE}/cluster/resources",
                 json={"data": [{"vmid": 200, "node": "pve1", "type": "qemu", "name": "gpu200", "status": "running"}]})
        rsps.add(responses.GET, f"{VM}/config", json={"data": {"hostpci0": "0000:41:00.0,pcie=1", "agent": "1", "ostype": "l26"}})
        rsps.add_callback(responses.GET, f"{VM}/status/current", callback=lambda req: _json(self.status))
        rsps.add_callback(responses.POST, f"{VM}/agent/exec", callback=self._exec)
        rsps.add_callback(responses.GET, f"{VM}/agent/exec-status", callback=self._exec_status)
        for what in POWER:
            rsps.add_callback(responses.POST, f"{VM}/status/{what}", callback=self._power(what))

    def _exec(self, req: Any) -> Answer:
        pid = len(self.execs) + 1
        self.execs[pid] = parse_qs(req.body)["command"]
        self.calls.append("exec")
        return _json({"pid": pid})

    def _exec_status(self, req: Any) -> Answer:
        argv = self.execs[int(parse_qs(req.url.split("?", 1)[1])["pid"][0])]
        return self.exec_status(argv) or _json(self.guest(argv))

    def guest(self, argv: list[str]) -> dict[str, Any]:
        """What the guest's agent says: the holder is listed by nvidia-smi and the scan until a kill reaches it."""
        if tuple(argv) == NVSMI_APPS:
            return {"exited": 1, "exitcode": 0, "out-data": "4242, 2048\n" if self.alive else ""}
        if tuple(argv) == NVSMI_GPUS:
            return {"exited": 1, "exitcode": 0, "out-data": f"0, 00000000:01:00.0, {2048 if self.alive else 0}\n"}
        if argv[:3] == ["sh", "-c", SCAN_SCRIPT]:
            return {"exited": 1, "exitcode": 0, "out-data": ("holder 4242 777 fd,maps python3\n" if self.alive else "") + "scan-done\n"}
        if argv[:3] == ["sh", "-c", KILL_SCRIPT]:
            self.alive = False
            return {"exited": 1, "exitcode": 0, "out-data": "sent 4242\nkill-done\n"}
        raise AssertionError(argv)

    def _power(self, what: str) -> Callable[[Any], Answer]:
        def answer(req: Any) -> Answer:
            self.calls.append(what)
            return _json(f"UPID:pve1:00001234:00005678:65000000:qm{what}:200:root@pam:")
        return answer

    def power(self) -> set[str]:
        return set(POWER) & set(self.calls)


@pytest.fixture
def remote():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield Remote(rsps)


def reset(**policy: Any) -> VmReport:
    pve = ProxmoxerPve(ProxmoxAPI("pve.test", user="root@pam", token_name="t", token_value="s", verify_ssl=True), node="pve1")
    return reset_vm(200, ProxmoxerVm(pve), FakeClock(), VmPolicy(**(FAST | policy)))


# -- 1: an exec-status answer that does not decode, or has no `exited` -------------------------------------------


@pytest.mark.parametrize("body", [
    b"\xff\xfe not utf-8 \x80",  # re-encoded by a proxy: proxmoxer hands back {"errors": b"..."}
    b"<html><body>502 Bad Gateway</body></html>",  # a proxy's own page
    json.dumps({"data": {"errors": {"pid": "invalid"}}}).encode(),  # a proxy's own JSON
    json.dumps({"data": {}}).encode(),
    json.dumps({"data": {"exited": "perhaps"}}).encode(),
], ids=["undecodable", "html", "errors-json", "empty", "exited-junk"])
@pytest.mark.parametrize("restart", [True, False], ids=["restart", "no-restart"])
def test_unreadable_exec_status_is_an_api_error_without_power_action(remote, body, restart):
    """An exec-status answer that does not decode or has no readable `exited` is exit 4, never 'still running', no power action."""
    remote.exec_status = lambda argv: (200, {"Content-Type": "application/json"}, body)
    rep = reset(restart=restart)
    assert rep.exit_code == E.EXIT_PVE and rep.outcome is VmOutcome.NOT_VERIFIED
    assert remote.power() == set() and not rep.power_requested


def test_unreadable_exec_status_after_the_signal_is_an_api_error_without_power_action(remote):
    """The exec-status of the kill does not decode: exit 4, no shutdown, stop or start of the VM."""
    remote.exec_status = lambda argv: (200, {"Content-Type": "text/html"}, b"<html>gateway</html>") if argv[:3] == ["sh", "-c", KILL_SCRIPT] else None
    rep = reset()
    assert rep.exit_code == E.EXIT_PVE and remote.power() == set() and not rep.power_requested


# -- 2: status/current about another guest ----------------------------------------------------------------------


@pytest.mark.parametrize("state", ["stopped", "running"])
def test_status_about_another_vm_is_an_api_error(remote, state):
    """status/current answering for VM 201 is exit 4 for VM 200: never 'not running', no look, no power action."""
    remote.status = {"vmid": 201, "status": state, "qmpstatus": state}
    rep = reset()
    assert rep.exit_code == E.EXIT_PVE and rep.outcome is not VmOutcome.NOT_RUNNING
    assert "exec" not in remote.calls and remote.power() == set()


def test_status_about_another_vm_before_the_reboot_is_not_acted_on(remote):
    """The holder survives its signals and the status read before the shutdown answers for VM 201: exit 4, no power action."""
    guest = remote.guest

    def survives(argv: list[str]) -> dict[str, Any]:
        if argv[:3] != ["sh", "-c", KILL_SCRIPT]:
            return guest(argv)
        remote.status = {"vmid": 201, "status": "running", "qmpstatus": "running"}
        return {"exited": 1, "exitcode": 0, "out-data": "sent 4242\nkill-done\n"}

    remote.guest = survives
    rep = reset()
    assert rep.exit_code == E.EXIT_PVE and remote.power() == set() and not rep.power_requested


# -- 3: output the agent cut --------------------------------------------------------------------------------------


def _cut(which: tuple[str, ...], flag: str) -> Callable[[list[str]], Answer | None]:
    """The listing of ``which`` is cut by the agent (``flag``): what made it through shows no holder."""
    def answer(argv: list[str]) -> Answer | None:
        if tuple(argv[:len(which)]) != which:
            return None
        out = {NVSMI_APPS: "", NVSMI_GPUS: "0, 00000000:01:00.0, 0\n"}.get(tuple(argv), "scan-done\n")
        return _json({"exited": 1, "exitcode": 0, "out-data": out, flag: 1})
    return answer


@pytest.mark.parametrize("which", [NVSMI_APPS, NVSMI_GPUS, ("sh", "-c", SCAN_SCRIPT)], ids=["apps", "gpus", "scan"])
@pytest.mark.parametrize("flag", ["out-truncated", "err-truncated"])
def test_output_the_agent_cut_is_unknown_never_clean(remote, which, flag):
    """`out-truncated`/`err-truncated` from the agent: the listing is incomplete, exit 4, nothing signalled, no power action."""
    remote.alive = False  # whatever made it through shows no holder: only the flag says the listing is incomplete
    remote.exec_status = _cut(which, flag)
    rep = reset()
    assert rep.exit_code == E.EXIT_PVE and rep.outcome is VmOutcome.NOT_VERIFIED
    assert rep.signalled == [] and remote.power() == set()


def test_listing_longer_than_pvegpu_reads_is_unknown_never_clean(remote):
    """nvidia-smi lists more lines than pvegpu reads (a holder past the cut): exit 4, never clean, no power action."""
    remote.alive = False
    out = "\n" * MAX_LINES + "4242, 2048\n"
    remote.exec_status = lambda argv: _json({"exited": 1, "exitcode": 0, "out-data": out}) if tuple(argv) == NVSMI_APPS else None
    rep = reset()
    assert rep.exit_code == E.EXIT_PVE and rep.outcome is VmOutcome.NOT_VERIFIED and remote.power() == set()


def test_well_formed_answers_still_reset_the_vm(remote):
    """The scripted guest, answers well formed: the holder is signalled and the VM verified clean, exit 0, no power action."""
    rep = reset()
    assert rep.exit_code == E.EXIT_OK and rep.outcome is VmOutcome.CLEAN and remote.power() == set()
    assert [s["pid"] for s in rep.signalled] == [4242]


# -- 4: the verdict after the signals comes from a look that began after them ---------------------------------------


@pytest.mark.parametrize("restart", [False, True], ids=["no-restart", "restart"])
def test_slow_look_after_the_signal_judges_on_a_fresh_view(restart):
    """A look takes longer than each wait after a signal and the verify timeout; the holder went at SIGTERM: exit 0, no power action."""
    clock = FakeClock()
    vm = FakeVm(clock, exec_cost=1.0)  # each command 1 s: a look (three commands) outlasts grace, kill_wait and timeout
    rep = reset_vm(200, vm, clock, VmPolicy(grace=0.5, kill_wait=0.5, timeout=2.0, settle=0.25, restart=restart))
    assert rep.exit_code == E.EXIT_OK and rep.outcome is VmOutcome.CLEAN
    assert rep.after is not None and rep.after.killable == [] and not {"shutdown", "stop", "start"} & set(vm.calls)


def test_slow_look_keeps_the_grace_before_sigkill():
    """A look longer than the grace is not started, and the SIGKILL still waits the grace after the SIGTERM."""
    clock = FakeClock()
    vm = FakeVm(clock, exec_cost=1.0, kill_ignored=True)
    sent: list[tuple[str, float]] = []
    original = vm.agent_exec

    def exec_(g: Any, argv: list[str]) -> int:
        if argv[:3] == ["sh", "-c", KILL_SCRIPT]:
            sent.append((argv[4], clock.t))
        return original(g, argv)

    vm.agent_exec = exec_
    grace = 2.5  # shorter than a look (3 s): no look is started in it
    reset_vm(200, vm, clock, VmPolicy(grace=grace, kill_wait=0.5, timeout=1.0, restart=False))
    (term, t_term), (kill, t_kill) = sent[:2]
    assert (term, kill) == ("TERM", "KILL") and t_kill - t_term >= grace


# -- 5: HA that will not act is named at once -----------------------------------------------------------------------


def _ha_vm(clock: FakeClock, state: str) -> FakeVm:
    """A VM whose holder survives every signal (a reboot is due), HA-managed in ``state``; HA carries out no request."""
    vm = FakeVm(clock, kill_ignored=True, status={"status": "running", "qmpstatus": "running", "ha": {"managed": 1, "state": state}})

    def power(what: str, state: str) -> str:
        vm.calls.append(what)
        return f"UPID:{what}"

    vm._power = power
    return vm


def _ha_named(rep: VmReport) -> set[str]:
    return {str(s.detail.get("ha_state")) for s in rep.steps if s.detail.get("ha_state") is not None}


@pytest.mark.parametrize("state", ["error", "fence", "recovery", "freeze", "ignored"])
def test_ha_that_will_not_act_is_named_before_any_power_request(state):
    """An HA-managed VM in a state where HA will not act: named at once, exit 4, no shutdown, stop or start requested."""
    clock = FakeClock()
    vm = _ha_vm(clock, state)
    pol = VmPolicy(grace=0.2, kill_wait=0.2, timeout=0.5, task_timeout=10.0)
    rep = reset_vm(200, vm, clock, pol)
    assert rep.exit_code == E.EXIT_PVE and _ha_named(rep) == {state}
    assert not {"shutdown", "stop", "start"} & set(vm.calls) and not rep.power_requested and rep.elapsed < pol.task_timeout


def test_ha_that_stops_acting_mid_reboot_is_named_at_once():
    """HA goes to 'fence' after the shutdown request: named at the first status read, no stop or start after it, exit 4."""
    clock = FakeClock()
    vm = _ha_vm(clock, "started")

    def shutdown(g: Any, timeout: int) -> str:
        vm.calls.append("shutdown")
        vm.status["ha"] = {"managed": 1, "state": "fence"}
        return "UPID:shutdown"

    vm.vm_shutdown = shutdown
    pol = VmPolicy(grace=0.2, kill_wait=0.2, timeout=0.5, task_timeout=10.0, state_wait=5.0)
    t0 = clock.t
    rep = reset_vm(200, vm, clock, pol)
    assert rep.exit_code == E.EXIT_PVE and "fence" in _ha_named(rep) and not rep.left_stopped
    assert [c for c in vm.calls if c in ("shutdown", "stop", "start")] == ["shutdown"]
    assert clock.t - t0 < pol.task_timeout


# -- the same checks on the local backend (pvesh as root on the node) -----------------------------------------------


@pytest.mark.parametrize("call,rule", [
    ("exec-status", {"json": {"out-data": "scan-done\n"}}),
    ("exec-status", {"json": {"exited": "got timeout"}}),  # the agent's words inside a bad answer are not the agent's error
    ("status", {"json": {"vmid": 201, "status": "stopped"}}),
    ("status", {"json": {"vmid": 200, "status": "unknown"}}),
])
def test_pvesh_answers_are_checked_at_the_edge(pvesh, call, rule):
    """Through pvesh too: an exec-status without a readable `exited` or a status about another VM is an API error (exit 4), not one that reboots."""
    make, _ = pvesh
    path = {"exec-status": "get /nodes/pve1/qemu/200/agent/exec-status", "status": "get /nodes/pve1/qemu/200/status/current"}[call]
    vm = ProxmoxerVm(make({path: rule}))
    guest = Guest(200, "pve1", "qemu")
    with pytest.raises(E.PveApiError) as exc:
        vm.agent_exec_status(guest, 7) if call == "exec-status" else vm.vm_status(guest)
    assert exc.value.exit_code == E.EXIT_PVE and not isinstance(exc.value, REBOOTABLE)
