"""Reset under signals: the handlers raise at most once, a signal escaping in the critical section never claims "not
stopped", the report still comes (a third signal, a SIGTERM as it prints, a terminal gone under -v), --json still
gets a document, and the message names the guest as far as it is known (guest, then CT or VM)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from pvegpu import wiring
from pvegpu.adapters.logs import configure
from pvegpu.cli import reset as resetcmd
from pvegpu.cli import run
from pvegpu.core import errors as E
from pvegpu.core.model import Guest
from pvegpu.core.ports import Interrupted
from pvegpu.reset import Ports, ResetPolicy, reset
from pvegpu.reset.vocab import StepName
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve
from tests.pvelike import REPO


@pytest.fixture
def init_holds():
    """CT 129 whose init holds GPU 0: only the restart (stop, verify, start) can clean it."""
    clock = FakeClock()
    host = FakeHost(clock)
    probe = FakeProbe(host)
    pve = FakePve(host)
    pve.add_ct(129)
    init = host.add(129, init=True, comm="init")
    init.minors = {0}
    probe.context(0, 700, init)
    return clock, host, probe, pve


def test_after_the_run_ending_signal_later_ones_are_only_recorded():
    """Before the stop request: the first SIGINT ends the run (Interrupted), a second one while it unwinds is only recorded."""
    with resetcmd._Signals(129) as sigs:
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # raising here would break the "not stopped" report being made
        assert sigs.received() == ("SIGTERM", 128 + signal.SIGTERM)


def test_after_the_abandon_a_further_signal_is_only_recorded():
    """In the critical section: the first signal is recorded, the second abandons, a third raises nothing."""
    with resetcmd._Signals(129) as sigs:
        sigs.critical()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(Interrupted) as got:
            os.kill(os.getpid(), signal.SIGTERM)
        assert got.value.abandoned
        os.kill(os.getpid(), signal.SIGINT)
    assert sigs.received() == ("SIGINT", 130)


def test_a_signal_escaping_after_the_stop_request_never_says_not_stopped(monkeypatch):
    """An Interrupted that leaves reset() once the critical section began: the error says the CT may be STOPPED, exit 128+n."""
    class Ports:
        lock = interrupts = None

    class World:
        @contextlib.contextmanager
        def reset_ports(self, log, exiting=False):
            yield Ports()

    def reset(vmid, ports, policy, on_step, on_wait):
        ports.interrupts.critical()
        raise Interrupted("SIGTERM", 143, abandoned=True)

    journal: list[str] = []
    monkeypatch.setattr(resetcmd, "reset", reset)
    monkeypatch.setattr(wiring, "ct_lock", lambda *a: contextlib.nullcontext(object()))
    monkeypatch.setattr(wiring, "reset_policy", lambda s, dry_run: None)
    monkeypatch.setattr(wiring, "journal_line", journal.append)
    s = type("S", (), {"reset": type("R", (), {"lock_wait": 1.0})()})()
    with resetcmd._Signals(129) as sigs, pytest.raises(E.SignalledError) as err:
        resetcmd._guarded(sigs, lambda: resetcmd._ct_reset(s, 129, World(), sigs, dry_run=False, json_out=True, verbose=False))
    assert err.value.exit_code == 143
    assert "may be STOPPED" in err.value.message and "not stopped" not in err.value.message
    assert journal and "not stopped" not in journal[0]


def test_json_lines_on_a_closed_pipe_do_not_raise(monkeypatch):
    """`reset --json -v`: the JSON-lines event log on a stderr whose reader went away (EPIPE) drops the event, never raises."""
    class Pipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Pipe())
    log = configure(verbose=True, json_lines=True)
    log.info("reset.signal", vmid=129, signal="SIGTERM")
    log.warning("reset.restart", vmid=129)


def test_a_sigint_while_the_guest_is_located_is_the_handlers_and_gets_a_json_error(monkeypatch, capsys):
    """SIGINT during where() (the handlers are already in place): exit 130, a pvegpu-error document, "not stopped" journalled."""
    class Pve:
        def where(self, vmid):
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("the handler raises at the signal")

    journal: list[str] = []
    monkeypatch.setattr(wiring, "world", lambda s, **kw: type("W", (), {"pve": Pve()})())
    monkeypatch.setattr(wiring, "journal_line", journal.append)
    code = run(["reset", "129", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 130 and doc["schema"] == "pvegpu-error" and doc["exit_code"] == 130
    assert journal and "was not stopped" in journal[0]


def test_a_third_signal_after_the_stop_request_still_gives_the_report(init_holds):
    """Ctrl-C three times after the stop request: reset() still returns a report saying where the CT is (never raises)."""
    clock, host, probe, pve = init_holds
    real_stop = pve.ct_stop

    def stop(g):
        upid = real_stop(g)
        os.kill(os.getpid(), signal.SIGINT)  # first: recorded, the restart is to be finished
        os.kill(os.getpid(), signal.SIGINT)  # second: abandons (Interrupted raised here)
        return upid

    pve.ct_stop = stop

    def on_step(st):
        if st.name == StepName.INTERRUPTED:
            os.kill(os.getpid(), signal.SIGINT)  # a third, while the abandon is being reported

    with resetcmd._Signals(129) as sigs:
        try:
            r = reset(129, Ports(pve, probe, host, clock, interrupts=sigs), ResetPolicy(timeout=1.0), on_step)
        except Interrupted as exc:  # do_reset would then print "before any stop was requested: CT 129 was not stopped"
            pytest.fail(f"reset() raised Interrupted({exc.signame}) after the stop request: the report is lost")
    assert r.exit_code == 130 and r.left_stopped and r.interrupted


def test_a_sigterm_while_the_final_report_prints_does_not_kill_it(sim_node):
    """A SIGTERM as the finished reset prints its --json report: the report still comes out whole, no default-action death."""
    node = sim_node({"node": "s", "gpus": [{"minor": 0, "index": 0, "stand_in": "/dev/full"}],
                     "containers": [{"vmid": 129, "status": "stopped", "gpus": [0]}]})
    code = ("import os, signal, sys; from pvegpu.cli import reset as resetcmd; from pvegpu.cli import run; say = resetcmd._say\n"
            "def _say(text, err=True):\n"
            "    if not err and text.lstrip().startswith('{'): os.kill(os.getpid(), signal.SIGTERM)\n"
            "    say(text, err)\n"
            "resetcmd._say = _say\n"
            f"sys.exit(run(['--simulate', {node.root!r}, 'reset', '129', '--dry-run', '--json']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode in (0, 143) and r.returncode != -signal.SIGTERM, (r.returncode, r.stderr[-400:])
    assert json.loads(r.stdout)["schema"] == "pvegpu-reset"


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_reset_json_gets_a_document_for_a_ctrl_c_or_an_internal_error_before_the_lock(exc, monkeypatch, capsys):
    """Ctrl-C while the guest is located (before the handlers), or an internal error: --json still gets a pvegpu-error document."""

    class Pve:
        def where(self, vmid):
            raise exc("boom")

    monkeypatch.setattr(wiring, "world", lambda s, **kw: type("W", (), {"pve": Pve()})())
    code = run(["reset", "129", "--json"])
    out = capsys.readouterr().out
    assert code in (1, 130)
    doc = json.loads(out) if out.strip() else {}
    assert doc.get("schema") == "pvegpu-error" and doc.get("exit_code") == code, out


class _Terminal:
    """stderr on a tty: once ``gone`` (the session hung up), every write fails with EIO, as a tty's do."""

    gone = False

    def write(self, text):
        if self.gone:
            raise OSError(5, "Input/output error")
        return len(text)

    def flush(self):
        if self.gone:
            raise OSError(5, "Input/output error")


def test_with_v_a_dropped_session_does_not_crash_the_restart(init_holds, monkeypatch):
    """`reset -v` whose terminal goes away after the stop request: the event log's writes fail, the restart still ends."""
    clock, host, probe, pve = init_holds
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    log = configure(verbose=True, json_lines=False)
    real_stop = pve.ct_stop

    def stop(g):
        upid = real_stop(g)
        tty.gone = True  # the session dropped while the stop ran
        return upid

    pve.ct_stop = stop
    try:
        r = reset(129, Ports(pve, probe, host, clock, log=log), ResetPolicy(timeout=1.0))
    except OSError as exc:
        pytest.fail(f"the reset crashed after the stop request ({exc}); CT 129 left {pve.status[129]['status']}")
    assert r.restarted and pve.status[129]["status"] == "running"


# -- the guest named as far as it is known ------------------------------------------------------------------


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
