"""Adversarial review, round 3 (review1): reset's signals, its --json contract, the settings snapshot, the gate."""

from __future__ import annotations

import os
import signal

import pytest

from pvegpu.cli import reset as resetcmd
from pvegpu.core.ports import Interrupted
from pvegpu.reset import Ports, ResetPolicy, reset
from pvegpu.reset.vocab import StepName
from tests.fakes import FakeClock, FakeHost, FakeProbe, FakePve


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


@pytest.mark.parametrize("line", [["129", "--json", "--grace"], ["129", "--json", "--bogus"], ["129", "130", "--json"],
                                  ["129", "--json", "--timeout", "x"]])
def test_a_reset_usage_error_with_json_is_a_pvegpu_error_document(line, capsys):
    """`pvegpu reset ... --json` with a bad line: exit 2 and a pvegpu-error document on stdout (README: errors with --json)."""
    import json

    from pvegpu.cli import run

    code = run(["reset", *line])
    out = capsys.readouterr().out
    assert code == 2
    doc = json.loads(out) if out.strip() else {}
    assert doc.get("schema") == "pvegpu-error" and doc.get("exit_code") == 2, out


def test_a_sigterm_while_the_final_report_prints_does_not_kill_it(sim_node):
    """A SIGTERM arriving as the finished reset prints its --json report: the report still comes out whole (the
    `done` state of the handlers exists for this), not a process killed by the default action."""
    import json
    import subprocess
    import sys

    from tests.pvelike import REPO

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


@pytest.mark.root
def test_the_racy_margin_counts_from_the_read_not_from_the_snapshot_write(tmp_path, monkeypatch):
    """A file read inside the racy margin gets no snapshot even if its parse ends after the margin (a slow run):
    a same-size second write in the same tick, after the read, would otherwise hide behind the snapshot."""
    import time as real_time

    from pvegpu.adapters import settingsfile

    f = tmp_path / "pvegpu.toml"
    f.write_text("[gate]\non_unknown = \"allow\"\n")
    f.chmod(0o644)
    later = type("T", (), {"time_ns": staticmethod(lambda: real_time.time_ns() + 3_000_000_000)})
    real_parse = settingsfile._parse

    def slow_parse(raw, path, problems):  # the run is descheduled for 3 s between its read and its snapshot write
        monkeypatch.setattr(settingsfile, "time", later)
        return real_parse(raw, path, problems)

    monkeypatch.setattr(settingsfile, "_parse", slow_parse)
    snap = tmp_path / "snap"
    settingsfile.load(str(f), env={}, snapshot_dir=str(snap))
    assert not (snap / "settings-other.snapshot").exists()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_reset_json_gets_a_document_for_a_ctrl_c_or_an_internal_error_before_the_lock(exc, monkeypatch, capsys):
    """Ctrl-C while the guest is located (before the handlers), or an internal error: --json still gets a pvegpu-error document."""
    import json

    from pvegpu import wiring
    from pvegpu.cli import run

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
    """`reset -v`: the terminal goes away (SIGHUP) after the stop request; the event log's writes fail, yet the
    restart is finished and a report comes back (the log must not raise into the reset)."""
    import sys

    from pvegpu.adapters.logs import configure

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
