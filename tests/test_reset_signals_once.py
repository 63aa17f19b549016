"""Reset's signal handlers raise at most once, and a signal escaping in the critical section never claims "not stopped"."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from pvegpu import wiring
from pvegpu.cli import reset as resetcmd
from pvegpu.core import errors as E
from pvegpu.core.ports import Interrupted


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
    import sys

    from pvegpu.adapters.logs import configure

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
    import json

    from pvegpu.cli import run

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
