"""Open review findings: the postinst's storage probes under a deadline, the wording before a guest is located,
the VM reset's waits on Deadline, and reset's and demo's human output in 80 columns."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pvegpu import frontdoor, wiring
from pvegpu.model import Guest

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
    monkeypatch.setattr(wiring, "world", lambda s: type("W", (), {"pve": Pve()})())
    monkeypatch.setattr(wiring, "ct_lock", lock)
    monkeypatch.setattr(wiring, "vm_api", lambda s: None)
    monkeypatch.setattr(wiring, "journal_line", journal.append)
    code = frontdoor.main(["reset", "129", "--json"])
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
