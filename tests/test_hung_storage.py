"""A storage that never answers (a dead NFS server, a hung FUSE mount): the postinst's guard refresh and `hook install
| status | uninstall` each probe it under a deadline, end in time, name the storage and change nothing on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pvegpu.cli import install as ins
from pvegpu.core import contract
from tests.pvelike import etc_pve
from tests.schemas import validate
from tests.test_fuse_scan import DAEMON

OLD_GUARD = ("#!/bin/sh\n# pvegpu start gate for Proxmox VE containers (an older pvegpu's text)\n"
             "PVEGPU=/opt/pvegpu/bin/pvegpu\nexec \"$PVEGPU\" hook \"$1\" \"$2\"\n")
SLOW = 0.5  # the probe deadline in these tests (the product's is install.STORAGE_DEADLINE)
BOUND = SLOW + 2.5  # what a refresh may take with one hung storage: the deadline, a fork, a loaded machine


def _node(tmp_path, dead_path=None, confs=None):
    """A PVE-like tree: storage `local` (a directory) and `nfs` (a directory, or ``dead_path``); CT 129 guarded
    on nfs, CT 130 unguarded."""
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
    for name in names:
        real = getattr(ins, name)

        def slow(path, *a, _real=real, **k):
            if str(path).startswith(str(where)):
                time.sleep(60)
            return _real(path, *a, **k)

        monkeypatch.setattr(ins, name, slow)


def _timed(fn, *a, **k):
    t = time.monotonic()
    out = fn(*a, **k)
    return out, time.monotonic() - t


def test_refresh_with_a_storage_that_never_answers_ends_in_time_and_names_it(tmp_path, monkeypatch):
    """The postinst's refresh with one storage hung: its guard is left and named in time, the other's is rewritten."""
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
    pve, _, nfs = _node(tmp_path)
    _hang_under(monkeypatch, nfs, "_check_dir")
    ran: list[list[str]] = []
    plan, took = _timed(ins.install, [130], pve_root=pve, node="pve1", storage_name="nfs", run=lambda a: (ran.append(a), (0, ""))[1],
                        guard="#!/bin/sh\n", deadline=SLOW)
    assert took < BOUND and not plan.ok and ran == []
    assert any("storage nfs" in r for r in plan.refused)


def test_status_of_a_guard_on_a_storage_that_never_answers_is_unknown(tmp_path, monkeypatch):
    """`hook status`: a CT whose guard's storage does not answer is `unknown`, named, in time; the document validates."""
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
    """`hook uninstall` of a chain whose storage does not answer: refused in time, naming it; the hookscript is untouched."""
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
    """A real hung FUSE mount (its probe stuck in the kernel past SIGKILL): the refresh ends in time, names it, goes on."""
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
