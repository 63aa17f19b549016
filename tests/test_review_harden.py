"""Open review findings: the postinst's storage probes under a deadline, the wording before a guest is located,
the VM reset's waits on Deadline, and reset's and demo's human output in 80 columns."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pvegpu import wiring
from pvegpu.cli import run
from pvegpu.core.model import Guest

# -- wording before the guest is located ---------------------------------------------------------------------


def _interrupted_reset(monkeypatch, capsys, guest, where_signal=False):
    """`pvegpu reset 129 --json` with a SIGINT in where() (``where_signal``) or, once located, as the lock is taken."""

    class Pve:
        def where(self, vmid):
            if where_signal:
                os.kill(os.getpid(), signal.SIGINT)
            return guest

    def lock(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the handler raises at the signal")

    journal: list[str] = []
    monkeypatch.setattr(wiring, "world", lambda s, **kw: type("W", (), {"pve": Pve(), "warm_up": lambda self: None})())
    monkeypatch.setattr(wiring, "ct_lock", lock)
    monkeypatch.setattr(wiring, "vm_api", lambda s: None)
    monkeypatch.setattr(wiring, "journal_line", journal.append)
    code = run(["reset", "129", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 130 and doc["schema"] == "pvegpu-error" and doc["exit_code"] == 130
    assert journal == [doc["error"]]
    return doc["error"]


def test_a_signal_before_the_guest_is_located_says_guest_not_ct(monkeypatch, capsys):
    """SIGINT while the guest is being located (it is a VM): the error and the journal say "guest 129", never "CT 129"."""
    msg = _interrupted_reset(monkeypatch, capsys, Guest(129, "pve1", "qemu"), where_signal=True)
    assert "guest 129" in msg and "CT 129" not in msg and "VM 129" not in msg and "not stopped" in msg


@pytest.mark.parametrize(("type_", "word", "other"), [("lxc", "CT", "VM"), ("qemu", "VM", "CT")])
def test_a_signal_once_the_guest_is_located_uses_its_kind(monkeypatch, capsys, type_, word, other):
    """SIGINT after the guest was located (before any stop): the wording is the guest's kind, CT or VM."""
    msg = _interrupted_reset(monkeypatch, capsys, Guest(129, "pve1", type_))
    assert f"{word} 129" in msg and f"{other} 129" not in msg and "guest 129 was" not in msg and "not stopped" in msg


# -- the VM reset's waits: Deadline on the Clock port --------------------------------------------------------


def test_vm_reset_computes_no_deadline_with_float_arithmetic():
    """vmreset.py and vmguest.py hold no `monotonic() + x` nor `x - monotonic()` (a deadline or the time left by
    hand): every wait there is a Deadline on the Clock port (a duration, `monotonic() - t0`, is fine)."""
    import ast

    from tests.pvelike import REPO

    def is_now(node):
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "monotonic"

    for name in ("vm/reset.py", "vm/guest.py"):
        tree = ast.parse(open(os.path.join(REPO, "pvegpu", name), encoding="utf-8").read())
        bad = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp)
               and ((isinstance(n.op, ast.Add) and (is_now(n.left) or is_now(n.right))) or (isinstance(n.op, ast.Sub) and is_now(n.right)))]
        assert bad == [], (name, bad)


def test_agent_silent_after_the_reboot_is_given_up_at_task_timeout():
    """After the reboot the agent never answers: its pings stop at task_timeout exactly (never a 1 s pause past it)."""
    from pvegpu.core import errors as E
    from pvegpu.testing import FakeClock
    from pvegpu.vm.guest import AgentUnavailable
    from pvegpu.vm.reset import VmOutcome, VmPolicy, reset_vm
    from tests.test_review_vm import FakeVm

    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)
    pings: list[float] = []

    def ping(g):
        pings.append(clock.t)
        raise AgentUnavailable("the guest agent of VM 200 does not answer", None)

    vm.agent_ping = ping
    pol = VmPolicy(grace=1, kill_wait=1, timeout=1, task_timeout=2.5)
    rep = reset_vm(200, vm, clock, pol)
    assert rep.outcome is VmOutcome.NOT_VERIFIED and rep.exit_code == E.EXIT_PVE and rep.restarted
    assert len(pings) >= 3 and pol.task_timeout - 1.0 < pings[-1] - pings[0] <= pol.task_timeout


def test_every_command_in_the_guest_ends_by_its_deadline():
    """A command that never exits in the guest: given up at exec_timeout, or at the phase's deadline when that
    comes first, on the clock (GuestTimeout), never later."""
    from pvegpu.core.deadline import deadline_in
    from pvegpu.testing import FakeClock
    from pvegpu.vm.guest import Guestside, GuestTimeout
    from tests.test_review_vm import FakeVm

    clock = FakeClock()
    vm = FakeVm(clock)
    vm.agent_exec_status = lambda g, pid: {"exited": 0}
    gs = Guestside(vm, vm.guest, clock, exec_timeout=3.0, poll=0.7)
    for phase, bound in ((None, 3.0), (1.25, 1.25), (10.0, 3.0)):
        t0 = clock.t
        with pytest.raises(GuestTimeout):
            gs.run(["true"], what="true", deadline=None if phase is None else deadline_in(clock, phase))
        assert bound - 0.7 < clock.t - t0 <= bound + 1e-9


def test_a_holder_that_never_goes_ends_the_vm_reset_by_its_deadlines():
    """A guest holder that ignores every signal, --no-restart: the waits (grace, kill_wait, the verify timeout)
    end by their deadlines on the fake clock, so the reset takes no more than their sum; exit 6."""
    from pvegpu.core import errors as E
    from pvegpu.testing import FakeClock
    from pvegpu.vm.reset import VmPolicy, reset_vm
    from tests.test_review_vm import FakeVm

    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)
    pol = VmPolicy(restart=False, grace=1.5, kill_wait=1.0, timeout=2.0, poll=0.3)
    rep = reset_vm(200, vm, clock, pol)
    assert rep.exit_code == E.EXIT_HOLDERS_LEFT
    assert pol.timeout <= rep.elapsed <= pol.grace + pol.kill_wait + pol.timeout + 0.01, rep.elapsed


# -- storage probes under a deadline (hook install | uninstall | status, the postinst's refresh) -------------

OLD_GUARD = ("#!/bin/sh\n# pvegpu start gate for Proxmox VE containers (an older pvegpu's text)\n"
             "PVEGPU=/opt/pvegpu/bin/pvegpu\nexec \"$PVEGPU\" hook \"$1\" \"$2\"\n")
SLOW = 0.5  # the probe deadline in these tests (the product's is install.STORAGE_DEADLINE)
BOUND = SLOW + 2.5  # what a refresh may take with one hung storage: the deadline, a fork, a loaded machine


def _node(tmp_path, dead_path=None, confs=None):
    """A PVE-like tree: storage `local` (a directory) and `nfs` (a directory, or ``dead_path``); CT 129 guarded
    on nfs, CT 130 unguarded."""
    from tests.pvelike import etc_pve

    vz, nfs = tmp_path / "vz", tmp_path / "nfs"
    for d in (vz, nfs):
        (d / "snippets").mkdir(parents=True)
        d.chmod(0o755)
        (d / "snippets").chmod(0o755)
    pve = etc_pve(str(tmp_path / "pve"), "pve1", confs or {129: "dev0: /dev/nvidia0\nhookscript: nfs:snippets/pvegpu-guard\n",
                                                           130: "dev0: /dev/nvidia0\n"})
    with open(os.path.join(pve, "storage.cfg"), "w") as f:
        f.write(f"dir: local\n\tpath {vz}\n\tcontent snippets\n\nnfs: nfs\n\tpath {dead_path or nfs}\n\tcontent snippets\n")
    return pve, vz / "snippets", nfs / "snippets"


def _hang_under(monkeypatch, where, *names):
    """The named probes of pvegpu.cli.install block (a dead NFS server) for any path under ``where``."""
    import time

    from pvegpu.cli import install as ins

    for name in names:
        real = getattr(ins, name)

        def slow(path, *a, _real=real, **k):
            if str(path).startswith(str(where)):
                time.sleep(60)
            return _real(path, *a, **k)

        monkeypatch.setattr(ins, name, slow)


def _timed(fn, *a, **k):
    import time

    t = time.monotonic()
    out = fn(*a, **k)
    return out, time.monotonic() - t


def test_refresh_with_a_storage_that_never_answers_ends_in_time_and_names_it(tmp_path, monkeypatch):
    """The postinst's refresh: the guard on a storage whose probe blocks is left as it is and named in a warning
    within the deadline; the guard on the storage that answers is still rewritten; the refresh does not fail."""
    from pvegpu.cli import install as ins

    pve, local, nfs = _node(tmp_path)
    for d in (local, nfs):
        (d / "pvegpu-guard").write_text(OLD_GUARD)
        (d / "pvegpu-guard").chmod(0o755)
    _hang_under(monkeypatch, nfs, "read_nofollow")
    plan, took = _timed(ins.refresh, pve, deadline=SLOW)
    assert took < BOUND and plan.ok
    assert [w for w in plan.warnings if "storage nfs" in w and "0.5 s" in w and str(nfs) in w]
    assert (local / "pvegpu-guard").read_text() == ins.guard_text(ins.template())
    assert (nfs / "pvegpu-guard").read_text() == OLD_GUARD


def test_install_onto_a_storage_that_never_answers_is_refused_in_time(tmp_path, monkeypatch):
    """`hook install --storage nfs` on a dead mount: refused within the deadline, naming the storage; no `pct set`."""
    from pvegpu.cli import install as ins

    pve, _, nfs = _node(tmp_path)
    _hang_under(monkeypatch, nfs, "_check_dir")
    ran: list[list[str]] = []
    plan, took = _timed(ins.install, [130], pve_root=pve, node="pve1", storage_name="nfs", run=lambda a: (ran.append(a), (0, ""))[1],
                        guard="#!/bin/sh\n", deadline=SLOW)
    assert took < BOUND and not plan.ok and ran == []
    assert any("storage nfs" in r for r in plan.refused)


def test_status_of_a_guard_on_a_storage_that_never_answers_is_unknown(tmp_path, monkeypatch):
    """`hook status`: a CT whose guard's storage does not answer is `unknown` (never guarded), named, in time;
    the document still validates."""
    from pvegpu.cli import install as ins
    from pvegpu.core import contract
    from tests.schemas import validate

    pve, _, nfs = _node(tmp_path)
    text = "#!/bin/sh\n"
    (nfs / "pvegpu-guard").write_text(text)
    (nfs / "pvegpu-guard").chmod(0o755)
    _hang_under(monkeypatch, nfs, "read_nofollow")
    st, took = _timed(ins.status, pve_root=pve, node="pve1", guard=text, deadline=SLOW)
    assert took < BOUND and not st.ok
    assert {r.vmid: r.state for r in st.containers}[129] is ins.GuardState.UNKNOWN
    assert any(p.startswith("CT 129:") and "storage nfs" in p for p in st.problems)
    validate(contract.document("hook-status", st.to_json() | {"attention": True}), "hook-status")


def test_uninstall_of_a_chain_on_a_storage_that_never_answers_leaves_the_hookscript(tmp_path, monkeypatch):
    """`hook uninstall` of a chained CT whose chain script's storage does not answer: refused in time, naming the
    storage, and its hookscript is not touched (its original is never dropped unread)."""
    from pvegpu.cli import install as ins

    pve, _, nfs = _node(tmp_path, confs={129: "dev0: /dev/nvidia0\nhookscript: nfs:snippets/pvegpu-guard-chain-129\n"})
    (nfs / "pvegpu-guard-chain-129").write_text("#!/bin/sh\n# original: local:snippets/mine.pl\n")
    _hang_under(monkeypatch, nfs, "read_nofollow")
    ran: list[list[str]] = []
    plan, took = _timed(ins.uninstall, [129], pve_root=pve, node="pve1", run=lambda a: (ran.append(a), (0, ""))[1], deadline=SLOW)
    assert took < BOUND and not plan.ok and ran == []
    assert any(r.startswith("CT 129:") and "storage nfs" in r for r in plan.refused)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_refresh_with_a_hung_fuse_storage_ends_in_time(tmp_path):
    """A real hung mount (a FUSE server that never answers, as a dead NFS server): the refresh's probe of it waits
    in the kernel, past SIGKILL, yet the refresh returns within its deadline, naming the storage, and the other
    storage's guard is rewritten."""
    import subprocess
    import sys

    from pvegpu.cli import install as ins
    from tests.test_fuse_scan import DAEMON

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, str(mnt), "-", "/dev/zero"], stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout is not None and daemon.stdout.readline().strip() == "ready"
        dead = f"/proc/{daemon.pid}/root{mnt}"  # the mount lives in the server's own mount namespace
        pve, local, _ = _node(tmp_path, dead_path=dead)
        (local / "pvegpu-guard").write_text(OLD_GUARD)
        (local / "pvegpu-guard").chmod(0o755)
        plan, took = _timed(ins.refresh, pve, deadline=SLOW)
        assert took < BOUND and plan.ok
        assert [w for w in plan.warnings if "storage nfs" in w and dead in w]
        assert (local / "pvegpu-guard").read_text() == ins.guard_text(ins.template())
    finally:
        daemon.kill()  # aborts the connection: the probe stuck on it ends
        daemon.wait(10)


# -- reset's and demo's human output in 80 columns --------------------------------------------------------------


def _widest_ct_report():
    """The widest realistic container report: ten neighbours on the GPU, a dry-run plan for a tenant's long
    escaped comm and nested cgroup, respawn notes, every diagnosis kind of line, left stopped, interrupted."""
    from pvegpu.core.holders import GpuFacts
    from pvegpu.core.model import MIB, GpuInfo, GpuSample, Holder, Place, Placement, ProcIdentity, ProcInfo
    from pvegpu.core.safetext import escape
    from pvegpu.reset.report import ResetOutcome, ResetReport
    from pvegpu.reset.vocab import Diagnosis, Kind

    comm = escape("\x1b[2J\x1b]0;pwn\x07trainer")  # a tenant's comm, escaped
    cgroup = "/lxc/129/" + "/".join(escape(f"ns{i}\x1b") for i in range(12))

    def holder(pid, vmid):
        place = Placement(Place.CONTAINER if vmid else Place.HOST, vmid)
        return Holder(ProcInfo(ProcIdentity(pid, 1), comm, "S", place, cgroup, pid), frozenset({0}), frozenset({"fd"}))

    gpu = GpuInfo(0, 0, "GPU-0", "0000:41:00.0")
    others = [holder(5000 + v, v) for v in range(130, 140)] + [holder(4999, None)]
    before = GpuFacts(gpu, GpuSample(0, 143_771 * MIB, ()), ct_holders=[holder(4000 + i, 129) for i in range(12)], other_holders=others)
    after = GpuFacts(gpu, GpuSample(0, 99_000 * MIB, ()), other_holders=others)
    long = f"pid 4001 ({comm}, CT pid 4001) in CT 129 still holds GPU 0 (/dev/nvidia0, GPU-0) (state D) " * 2
    r = ResetReport(129, "pve1", gpus=[0], before={0: before}, after={0: after}, outcome=ResetOutcome.NOT_VERIFIED, exit_code=130,
                    left_stopped=True, interrupted={"signal": "SIGINT", "action": "abandoned the restart at the second signal"},
                    plan=[{"pid": 4000, "comm": comm, "ns_pid": 4000, "cgroup": cgroup, "action": "SIGTERM, SIGKILL after the grace"}],
                    notes=[f"pid 4100 ({comm}, CT pid 4100) appeared after round 1, started by the container's init (pid 4, {comm})"],
                    diagnosis=[Diagnosis(Kind.HOLDER_LEFT, long, f"`pct exec 129 -- kill -9 4001` {long}"),
                               Diagnosis(Kind.NEIGHBOUR, long)], elapsed=31.25)
    return r, comm


def test_the_widest_reset_report_fits_80_columns_and_wide_keeps_one_line_per_item():
    """reset's report (table, plan, notes, verdict, diagnosis, left stopped, interrupted) and its step lines fit 80
    columns with the tenant's text wrapped whole (nothing cut); -v keeps one line per item."""
    from pvegpu.cli.render import reset_human, step_line
    from tests.test_columns import _width

    r, comm = _widest_ct_report()
    text = reset_human(r)
    assert _width(text) <= 80, text
    flat = " ".join(text.split())
    for whole in (comm, *(f"CT {v}" for v in range(130, 140)), "host", " ".join(r.diagnosis[0].problem.split())):
        assert whole in flat
    step = step_line("signal", f"SIGTERM → pid 4000 ({comm}, CT pid 4000, {r.plan[0]['cgroup']}): sent")
    assert _width(step) <= 80 and " ".join(step.split()).endswith("): sent")
    wide = reset_human(r, wide=True)
    assert len(wide.splitlines()) == 2 + 1 + 1 + 1 + 3 + 1 + 1  # table (2), plan, note, verdict, diagnosis (3), left stopped, interrupted
    assert len(step_line("signal", "x " * 100, wide=True).splitlines()) == 1


def test_the_widest_vm_report_fits_80_columns():
    """A VM's report with the guest's long text (diagnosis, task log, left stopped) fits 80 columns, nothing cut."""
    from pvegpu.vm.reset import VmOutcome, VmReport, vm_human
    from tests.test_columns import _width

    r = VmReport(200)
    r.outcome, r.exit_code, r.left_stopped, r.vm_state = VmOutcome.NOT_VERIFIED, 4, True, "stopped"
    guest_text = "nvidia-smi in VM 200 failed: " + "NVIDIA-SMI has failed because it couldn't communicate with the driver " * 2
    r.diagnosis = [(guest_text, "`qm guest exec 200 -- nvidia-smi`: is the driver loaded in the guest? " * 2)]
    r.task_log = ["TASK ERROR: " + "x" * 200]
    r.interrupted = {"signal": "SIGTERM", "action": "finished the reboot before exiting", "vm_state": "stopped", "left_stopped": True}
    text = vm_human(r)
    assert _width(text) <= 80, text
    assert " ".join(guest_text.split()) in " ".join(text.split()) and "x" * 60 in text.replace("\n      ", "")


def test_demo_output_fits_80_columns():
    """`pvegpu demo` (its audits, resets with a respawning supervisor and a restart, the summary) fits 80 columns."""
    from tests.test_columns import _pvegpu, _width

    r = _pvegpu("demo")
    assert r.returncode == 0, r.stderr
    assert _width(r.stdout) <= 80, "\n".join(line for line in r.stdout.splitlines() if len(line) > 80)


def test_postinst_runs_its_refresh_and_its_etc_pve_probe_under_timeout():
    """The postinst cannot hang apt: its /etc/pve probe and the refresh (whose /etc/pve reads have no deadline of
    their own; each storage's probes do) run under timeout(1), and a refresh that times out still exits 0."""
    import re

    from tests.pvelike import REPO

    text = open(os.path.join(REPO, "packaging", "debian", "postinst"), encoding="utf-8").read()
    body = text.split("configure)", 1)[1]
    lines = [ln.strip() for ln in body.splitlines()]
    runs = [ln for ln in lines if "/opt/pvegpu/bin/python3" in ln or (ln.startswith("if ") and "/etc/pve" in ln)]
    assert len(runs) == 2 and all(re.match(r"(if )?timeout (-k \d+ )?\d+ ", ln) for ln in runs), runs
    assert "|| echo" in body and text.rstrip().endswith("exit 0")


def test_a_vm_waiting_for_its_reset_lock_is_named_a_vm(tmp_path):
    """Another reset of VM 200 holds the lock: the busy error (exit 9) names VM 200, never CT 200."""
    from pvegpu.adapters.locks import ct_lock
    from pvegpu.cli import reset as resetcmd
    from pvegpu.core import errors as E

    locks = str(tmp_path / "locks")
    s = type("S", (), {"reset": type("R", (), {"lock_dir": locks, "lock_wait": 0.2})()})()
    with ct_lock(locks, 200, 0), resetcmd._Signals(200, "VM") as sigs, pytest.raises(E.BusyError) as err:
        resetcmd._vm_reset(s, 200, sigs, dry_run=False, json_out=True, verbose=False)
    assert err.value.exit_code == E.EXIT_BUSY and "VM 200" in err.value.message and "CT 200" not in err.value.message


def test_a_vm_reset_waiting_for_its_guest_agent_says_so_every_second():
    """After the reboot, a guest agent that does not answer is waited for with a progress line about once a second
    (what is waited for, for how long of how long), never a silent wait."""
    from pvegpu.testing import FakeClock
    from pvegpu.vm.guest import AgentUnavailable
    from pvegpu.vm.reset import VmPolicy, reset_vm
    from tests.test_review_vm import FakeVm

    clock = FakeClock()
    vm = FakeVm(clock, kill_ignored=True)

    def ping(g):
        raise AgentUnavailable("the guest agent of VM 200 does not answer", None)

    vm.agent_ping = ping
    said: list[str] = []
    reset_vm(200, vm, clock, VmPolicy(grace=1, kill_wait=1, timeout=1, task_timeout=4.5), on_progress=said.append)
    lines = [t for t in said if "guest agent after the reboot" in t]
    assert len(lines) >= 3 and all(" of 4.5" in t for t in lines)
