"""A review's attacks on dead listed pids, heirs and stopped holders, on real processes, cgroups and PID namespaces
(NVML stand-in on the driver model, gap on). Each failed before its fix; expectations are kinds and exit codes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests.test_heirs import MIB, E, GateState, _ident, _stopped_target, node, pvelike

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, PID namespaces)")]

# A worker that double-forks: the live listed parent keeps its context; a grandchild that maps the device is
# re-parented to the CT's init (it looks like an orphan heir), although its mapping is the live parent's.
JOB2 = r"""
import mmap, os, sys, time
fd = os.open('/dev/zero', os.O_RDWR)
m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
open('/proc/self/comm','w').write('job-worker')
if os.fork() == 0:
    if os.fork() == 0:
        open('/proc/self/comm','w').write('job-grand')
        time.sleep(300); os._exit(0)
    os._exit(0)
time.sleep(300)
"""

# A session leader (a service as systemd starts it) forks a holder child after "cuInit", then exits: the child keeps
# the leader's pid as its session and process group id (the link a tenant cannot forge across containers).
JOB_SID = r"""
import mmap, os, time
fd = os.open('/dev/zero', os.O_RDWR)
m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
os.setsid()
open('/proc/self/comm','w').write('job-leader')
if os.fork() == 0:
    open('/proc/self/comm','w').write('job-child')
    time.sleep(300); os._exit(0)
os._exit(0)
"""

# A holder with a clean-shutdown handler for SIGTERM, as most services have.
JOB3 = r"""
import mmap, os, signal, time
fd = os.open('/dev/zero', os.O_RDWR); m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
open('/proc/self/comm','w').write('job-handler')
time.sleep(300)
"""


def _ct_job(n, script: str, want: set[str], gone: str | None = None) -> int:
    [vmid] = pvelike.claim_vmids(1)
    n.vmids.append(vmid)
    n.cts.append(pvelike.start_ct(vmid, [sys.executable, "-c", script]))
    n._wait(lambda: want <= set(n.jobs(vmid)) and (gone is None or gone not in n.jobs(vmid)), f"CT {vmid}'s job")
    return vmid


def _sid_orphan(n) -> tuple[int, int, tuple[int, int]]:
    """A CT whose session leader died, its fork child lingering: (vmid, child pid, the dead leader's identity)."""
    vmid = _ct_job(n, JOB_SID, {"job-child"}, gone="job-leader")
    child = n.jobs(vmid)["job-child"]
    sid = int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[3])
    assert sid != child
    return vmid, child, (sid, 0)  # start 0: no live process has it (the leader is dead; its pid is kept as the sid)


def _freeze(vmid: int, pid: int) -> None:
    frz = os.path.join(pvelike.cgroup_dir(vmid), "frz")
    os.makedirs(frz, exist_ok=True)
    with open(os.path.join(frz, "cgroup.procs"), "w") as f:
        f.write(str(pid))
    with open(os.path.join(frz, "cgroup.freeze"), "w") as f:
        f.write("1")
    deadline = time.monotonic() + 10
    while "frozen 1" not in open(os.path.join(frz, "cgroup.events")).read():
        assert time.monotonic() < deadline, "the cgroup did not freeze"
        time.sleep(0.02)


# -- 1. a neighbour parks its fd during the target's reset ---------------------------------------------------------

def test_neighbour_parks_its_fd_during_the_targets_reset():
    """A neighbour's owner alive at the first reading and dead later (memory stays) never makes the target stopped."""
    with node() as n:
        other = n.ct("own")
        n.context(4096, n.jobs(other)["job-own"], pinned=True)
        target = n.ct("own")
        n.context(1024, n.jobs(target)["job-own"])
        victim = n.jobs(other)["job-own"]
        orig, calls = n.model.sample, [0]

        def sample(minors):
            calls[0] += 1
            if calls[0] == 2:
                os.kill(victim, signal.SIGKILL)
                n._wait(lambda: "job-own" not in n.jobs(other), "neighbour owner gone")
            return orig(minors)

        n.model.sample = sample
        rep = n.reset(target, restart=True, timeout=2.0)
        assert n.calls == [] and rep.exit_code == E.EXIT_OK, (rep.outcome, n.calls, rep.diagnosis)


# -- 2. a double-forked grandchild of a live listed process is no heir ---------------------------------------------

def test_double_forked_worker_absorbs_a_stopped_cts_leak():
    """A grandchild of a live listed process (re-parented to the CT's init) is no heir: the gate refuses the ghost."""
    with node() as n:
        ct = _ct_job(n, JOB2, {"job-worker", "job-grand"})
        jobs = n.jobs(ct)
        n.context(1024, jobs["job-worker"], _ident(jobs["job-grand"]))
        n.context(8192, n.dead_pid(), pinned=True)  # the stopped CT's leak
        res = n.gate(_stopped_target())
        assert not res.decision.allow and res.facts[0].heirs == {}, (res.facts[0].heirs, res.decision.reasons)


def test_double_fork_audit_view():
    """Audit credits no stranger's dead pid to a grandchild of a live listed process."""
    with node() as n:
        ct = _ct_job(n, JOB2, {"job-worker", "job-grand"})
        jobs = n.jobs(ct)
        n.context(1024, jobs["job-worker"], _ident(jobs["job-grand"]))
        n.context(8192, n.dead_pid(), pinned=True)
        row = n.audit().gpus[0]
        assert not any(h.inherited_from for h in row.holders)


# -- 3. a foreign leak and an orphan of the target ------------------------------------------------------------------

def test_neighbours_hidden_context_stops_target_with_an_orphan():
    """A foreign ghost competing with the target's own for the target's unlinked orphan never makes it stopped."""
    with node() as n:
        n.context(4096, n.dead_pid(), pinned=True)  # a neighbour's in-flight context, listed first
        target = n.ct("orphan")
        n.context(1024, n.dead_pid(), _ident(n.jobs(target)["job-child"]))
        rep = n.reset(target, restart=True, timeout=2.0)
        assert n.calls == [] and rep.exit_code == E.EXIT_OK, (rep.outcome, n.calls, rep.diagnosis)


def test_linked_orphan_takes_its_own_ghost_before_a_foreign_one():
    """The target's orphan is paired with its dead session leader, not a foreign ghost listed first; no stop."""
    with node() as n:
        n.context(4096, n.dead_pid(), pinned=True)
        target, child, leader = _sid_orphan(n)
        n.context(1024, leader, _ident(child))
        first = n.gate(target).facts[0]  # the same reading a reset starts from
        assert first.heirs == {leader[0]: child} and first.linked == [leader[0]], first.heirs
        rep = n.reset(target, restart=True, timeout=2.0)
        assert n.calls == [] and rep.exit_code == E.EXIT_OK, (rep.outcome, n.calls, rep.diagnosis)


def test_linked_orphans_leak_is_still_the_targets():
    """A linked ghost is provably the target's: when its memory stays after the orphan dies, reset exits 7."""
    with node() as n:
        n.context(4096, n.dead_pid(), pinned=True)
        target, child, leader = _sid_orphan(n)
        n.context(1024, leader, _ident(child), pinned=True)
        rep = n.reset(target, restart=False, timeout=1.0)
        assert rep.exit_code == E.EXIT_MEMORY_LEFT, (rep.outcome, rep.diagnosis)


# -- 4. audit credits each orphan with its own ghost ---------------------------------------------------------------

def test_audit_two_orphans_credited_to_the_right_containers():
    """Two containers' orphans, their dead leaders listed in the other order: each is credited its own bytes."""
    with node() as n:
        a, ca, la = _sid_orphan(n)
        b, cb, lb = _sid_orphan(n)
        n.context(8192, lb, _ident(cb))  # B's dead leader listed first
        n.context(1024, la, _ident(ca))
        row = n.audit().gpus[0]
        got = {h.pid: (h.inherited_from, h.memory_bytes // MIB) for h in row.holders if h.pid in (ca, cb)}
        assert got == {ca: (la[0], 1024), cb: (lb[0], 8192)}, got


# -- 5. NVML lists one row per process, however many contexts ------------------------------------------------------

def test_model_lists_one_row_per_process():
    """The driver model lists one row per owner pid (its contexts summed) while the gap counts every context."""
    with node() as n:
        ct = n.ct("own")
        for _ in range(16):
            n.context(518, n.jobs(ct)["job-own"])
        s = n.model.sample([0])[0]
        assert [p.used_bytes for p in s.processes] == [16 * 518 * MIB]
        assert s.used_bytes - 16 * 518 * MIB > 16 * 5 * MIB


def test_16_contexts_in_one_neighbour_process_fail_closed():
    """Known limit: 16 contexts in one neighbour process exceed the per-process allowance; the gate refuses."""
    with node() as n:
        ct = n.ct("own")
        for _ in range(16):
            n.context(518, n.jobs(ct)["job-own"])
        res = n.gate(_stopped_target())
        assert not res.decision.allow and res.decision.per_gpu[0] is not GateState.SHARED, res.decision.reasons


# -- 6. frozen holders -------------------------------------------------------------------------------------------

def test_frozen_holder_costs_the_grace():
    """A holder in a cgroup the tenant froze is stopped well within the grace."""
    with node() as n:
        target = n.ct("own")
        job = n.jobs(target)["job-own"]
        n.context(1024, job)
        _freeze(target, job)
        t = time.monotonic()
        rep = n.reset(target, grace=3.0, timeout=5.0)
        assert time.monotonic() - t < 1.5 and rep.exit_code == E.EXIT_OK, rep.outcome


def test_frozen_holder_with_a_term_handler_gets_sigkill_at_once():
    """A frozen holder with a SIGTERM handler (SIGTERM stays pending) gets SIGKILL at once, not after the grace."""
    with node() as n:
        vmid = _ct_job(n, JOB3, {"job-handler"})
        job = n.jobs(vmid)["job-handler"]
        n.context(1024, job)
        _freeze(vmid, job)
        t = time.monotonic()
        rep = n.reset(vmid, grace=3.0, timeout=5.0)
        assert time.monotonic() - t < 1.5 and rep.exit_code == E.EXIT_OK, rep.outcome
        assert [s["signal"] for s in rep.signalled if s["pid"] == job] == ["SIGKILL"], rep.signalled


# -- the owner parked its fd before the reset began ------------------------------------------------------------

def test_in_flight_fd_parked_before_the_reset_is_not_held_against_the_target():
    """A ghost already dead at the first reading cannot be placed: not the target's, no stop, named unexplained."""
    with node() as n:
        target = n.ct("own")
        owner = n.jobs(target)["job-own"]
        n.context(4096, owner, pinned=True)
        os.kill(owner, signal.SIGKILL)
        n._wait(lambda: "job-own" not in n.jobs(target), "owner gone")
        rep = n.reset(target, restart=True, timeout=2.0)
        assert n.calls == [] and rep.after[0].unexplained_ghosts == [owner], (rep.outcome, rep.diagnosis)
        assert not n.gate(_stopped_target()).decision.allow  # the gate still refuses starts onto that GPU

def test_cgroup_frozen_reads_cgroup_events(tmp_path):
    """The adapter's frozen flag comes from cgroup.events of the process's v2 cgroup (v2 root or hybrid unified)."""
    from pvegpu.adapters.procfs import cgroup_frozen

    for sub in ("", "unified"):
        d = tmp_path / sub / "lxc" / "7" / "ns"
        d.mkdir(parents=True)
        (d / "cgroup.events").write_text("populated 1\nfrozen 1\n")
        assert cgroup_frozen(b"4:memory:/\n0::/lxc/7/ns\n", str(tmp_path))
        (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")
        assert not cgroup_frozen(b"0::/lxc/7/ns\n", str(tmp_path))
        (d / "cgroup.events").unlink()
    assert not cgroup_frozen(b"0::/lxc/7/../../x\n", str(tmp_path)) and not cgroup_frozen(None, str(tmp_path))
