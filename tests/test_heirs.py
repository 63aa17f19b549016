"""Dead NVML-listed pids on real processes, cgroups and PID namespaces, with the driver model's gap on:
whose memory a ghost is (only a plausible heir's, one per ghost: never a double-forked grandchild of a live listed
process; an orphan paired with its own dead session leader first), a target judged on its own memory (a neighbour's
owner dying mid-reset, a ghost dead before the first reading), a crowded GPU (one row per process, a known limit of
16 contexts in one), a real leak. Each attack here made the old code say clean / shared / stop the wrong CT."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.procfs import DeviceTable, ProcHost
from pvegpu.adapters.procstat import read_stat
from pvegpu.audit.model import FlagKind
from pvegpu.audit.run import run_audit
from pvegpu.core import errors as E
from pvegpu.core.errors import PveApiError
from pvegpu.core.model import MIB, CtStatus, GpuInfo, Guest
from pvegpu.gate.decide import GatePolicy, GatePorts, GateState, evaluate
from pvegpu.reset import Ports, ResetPolicy, reset
from pvegpu.sim.driver import DriverModel
from pvegpu.sim.nvml import proc_alive
from tests import pvelike

ZERO = os.stat("/dev/zero").st_rdev
TABLE = DeviceTable({(os.major(ZERO), os.minor(ZERO)): 0})  # /dev/zero (it can be mapped, as CUDA maps /dev/nvidiaN)
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, PID namespaces)")
pytestmark = [pytest.mark.root, root]

# A GPU job stand-in: maps the device and keeps its fd (a CUDA context owner). Modes:
#   own     one holder
#   orphan  leads its own session (a service), forks a holder child after "cuInit", then exits: the child is
#           re-parented to the CT's init and keeps the dead leader's pid as its session id (the proven link)
#   worker  forks a holder child (a DataLoader worker) and stays: the child's parent owns the context
#   plain   holds nothing (a process that could be handed a recycled pid)
#   forge   holds nothing; for each byte read from the FIFO argv[2] it forks a child that calls setsid(), forks a
#           holder ("job-forged", in the new session) and exits: the tenant's try at a session with a dead pid's number
JOB = r"""
import mmap, os, sys, time
mode = sys.argv[1]
def name(n):
    open('/proc/self/comm', 'w').write(n)
if mode not in ('plain', 'forge'):
    fd = os.open('/dev/zero', os.O_RDWR)
    m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
name('job-' + mode)
if mode == 'orphan':
    os.setsid()
if mode in ('orphan', 'worker'):
    if os.fork() == 0:
        name('job-child')
        time.sleep(300)
        os._exit(0)
    if mode == 'orphan':
        os._exit(0)
if mode == 'forge':
    name('job-forge')
    tries = open(sys.argv[2], 'rb', buffering=0)
    while tries.read(1):
        leader = os.fork()
        if leader == 0:
            os.setsid()
            if os.fork() == 0:
                fd = os.open('/dev/zero', os.O_RDWR)
                m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
                name('job-forged')
                time.sleep(300)
                os._exit(0)
            os._exit(0)
        os.waitpid(leader, 0)
time.sleep(300)
"""


def _ident(pid: int) -> tuple[int, int]:
    st = read_stat(pid)
    assert st is not None, pid
    return (pid, st.start_ticks)


class Node:
    """PVE-like containers of real processes, a stand-in NVML on the driver model (gap, latency), a recording PVE."""

    def __init__(self) -> None:
        self.vmids: list[int] = []
        self.cts: list[subprocess.Popen[bytes]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.model = DriverModel(SystemClock(), lambda ident: proc_alive(*ident), (0,))
        self.model.names = {0: GpuInfo(0, 0, "GPU-standin-0", "0000:41:00.0")}
        self.host = ProcHost(TABLE)
        self.calls: list[str] = []
        self.node = "pve1"

    # -- building ---------------------------------------------------------------------------------------

    def ct(self, mode: str, *args: str) -> int:
        """A container running one job of ``mode``; returns its vmid once the job (and its child) are in place."""
        [vmid] = pvelike.claim_vmids(1)
        self.vmids.append(vmid)
        self.cts.append(pvelike.start_ct(vmid, [sys.executable, "-c", JOB, mode, *args]))
        want = {"own": {"job-own"}, "orphan": {"job-child"}, "worker": {"job-worker", "job-child"}, "plain": {"job-plain"},
                "forge": {"job-forge"}}[mode]
        self._wait(lambda: want <= set(self.jobs(vmid)) and (mode != "orphan" or "job-orphan" not in self.jobs(vmid)),
                   f"CT {vmid}'s {mode} job")
        return vmid

    def jobs(self, vmid: int) -> dict[str, int]:
        """comm -> host pid of the container's processes."""
        out = {}
        for pid in pvelike.ct_procs(vmid):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    out[f.read().strip()] = pid
            except OSError:
                pass
        return out

    def host_mapper(self, uid: int | None = None) -> int:
        """An unrelated host process (a local user's job, as ``uid`` if given) that maps the device."""
        python = sys.executable if uid is None else "/usr/bin/python3"  # the test's venv may not be readable by that user
        p = subprocess.Popen([python, "-c", JOB, "own"], stdin=subprocess.DEVNULL, user=uid, cwd="/")
        self.procs.append(p)
        self._wait(lambda: _comm(p.pid) == "job-own", "the host mapper")
        return p.pid

    def orphans_leader(self, vmid: int) -> tuple[int, int]:
        """The identity of the dead session leader whose ``orphan`` child lingers in CT vmid (start 0: no live
        process has it; the kernel keeps its pid as the child's session id; the stand-in init never reaps it)."""
        st = read_stat(self.jobs(vmid)["job-child"])
        assert st is not None
        leader = read_stat(st.sid)
        assert leader is None or leader.state == "Z", leader
        return (st.sid, 0)

    def dead_pid(self) -> tuple[int, int]:
        """The identity of a process that has exited (a listed pid the driver keeps)."""
        p = subprocess.Popen(["sleep", "30"])
        ident = _ident(p.pid)
        p.kill()
        p.wait()
        return ident

    def context(self, mib: int, owner: tuple[int, int] | int, *holders: tuple[int, int], **kw) -> None:
        self.model.open_context(0, mib * MIB, owner if isinstance(owner, tuple) else _ident(owner), *holders, **kw)

    @staticmethod
    def _wait(cond, what: str, limit: float = 20.0) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        for vmid, ct in zip(self.vmids, self.cts, strict=False):
            pvelike.destroy_ct(vmid)
            ct.kill()
            ct.wait()
            pvelike.release_vmid(vmid)

    # -- the PVE ports (PveReader for the gate, PveApi for reset and audit) -------------------------------

    def local_node(self) -> str:
        return self.node

    def where(self, vmid: int) -> Guest | None:
        return Guest(vmid, self.node, "lxc") if vmid in self.vmids or vmid == self.target else None

    def guests(self) -> list[Guest]:
        return [Guest(v, self.node, "lxc") for v in {*self.vmids, self.target}]

    def ct_config(self, guest: Guest) -> str:
        return "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"

    def ct_status(self, guest: Guest) -> CtStatus:
        return CtStatus("running")

    def ct_stop(self, guest: Guest) -> str:
        self.calls.append(f"stop {guest.vmid}")
        raise PveApiError(f"stop of CT {guest.vmid} refused by the test", "the innocent target must not be stopped")

    ct_start = ct_stop
    target = 0

    # -- running pvegpu -----------------------------------------------------------------------------------

    def reset(self, vmid: int, **policy):
        self.target = vmid
        pol = dict(grace=2.0, timeout=5.0, restart=False) | policy
        return reset(vmid, Ports(self, self.model, self.host, SystemClock()), ResetPolicy(**pol))

    def gate(self, vmid: int, **policy):
        self.target = vmid
        return evaluate(vmid, GatePorts(self, self.model, self.host), GatePolicy(**policy))

    def audit(self):
        return run_audit(pve=self, probe=self.model, host=self.host)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@contextmanager
def node():
    n = Node()
    try:
        yield n
    finally:
        n.close()


def _stopped_target() -> int:
    """A container id for a stopped target (no process, no cgroup)."""
    return random.randint(600_000, 699_999)


def test_unrelated_host_mapper_does_not_absorb_a_ghost():
    """A stopped CT's dead listed pid holds 8 GiB (the leak the gate exists for); a local user's process that maps
    the device is never its heir: the gate refuses instead of saying clean."""
    with node() as n:
        n.host_mapper()
        n.context(8192, n.dead_pid(), pinned=True)
        res = n.gate(_stopped_target())
        assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED
        assert res.facts[0].unexplained_ghosts and not res.facts[0].ghost_owners


def test_neighbours_dataloader_worker_does_not_absorb_a_ghost():
    """A neighbour's worker forked after CUDA init (its parent, listed and alive, owns the context) is no heir of
    another pid's 8 GiB: the gate refuses."""
    with node() as n:
        ct = n.ct("worker")
        n.context(1024, n.jobs(ct)["job-worker"], _ident(n.jobs(ct)["job-child"]))
        n.context(8192, n.dead_pid(), pinned=True)
        res = n.gate(_stopped_target())
        assert not res.decision.allow and res.facts[0].unexplained_ghosts


def test_recycled_pid_does_not_absorb_a_ghost():
    """NVML lists a pid with 8 GiB that a neighbour's plain process (no fd, no mapping) now has: a recycled pid, so
    a ghost nobody explains; the gate refuses instead of calling the 8 GiB the neighbour's ("shared")."""
    with node() as n:
        ct = n.ct("plain")
        n.context(8192, n.jobs(ct)["job-plain"], pinned=True)
        res = n.gate(_stopped_target())
        f = res.facts[0]
        assert not res.decision.allow and f.recycled == f.ghosts == [n.jobs(ct)["job-plain"]]


def test_neighbours_orphan_still_explains_its_own_dead_parent():
    """A neighbour's fork child re-parented to its CT's init, in its dead parent's session, explains that parent's
    memory (one heir, one ghost): the gate allows a shared start; audit credits the memory to that container."""
    with node() as n:
        ct = n.ct("orphan")
        child = n.jobs(ct)["job-child"]
        n.context(2048, n.orphans_leader(ct), _ident(child))
        res = n.gate(_stopped_target())
        assert res.decision.allow and res.decision.per_gpu[0] is GateState.SHARED, res.decision.reasons
        assert res.facts[0].heirs == {res.facts[0].ghosts[0]: child}
        row = n.audit().gpus[0]
        [h] = [h for h in row.holders if h.pid == child]
        assert h.memory_bytes == 2048 * MIB and h.inherited_from == res.facts[0].ghosts[0]


def test_neighbours_mapper_under_its_init_takes_no_dead_pids_memory():
    """A stopped CT's dead listed pid holds 8 GiB; a neighbour's process that maps the device and sits directly under
    its CT's init, with no group or session of that pid, is no heir: the gate refuses instead of allowing the start
    onto the 8 GiB, and audit credits it to nobody."""
    with node() as n:
        ct = n.ct("own")
        mapper = n.jobs(ct)["job-own"]
        n.context(8192, n.dead_pid(), pinned=True)
        res = n.gate(_stopped_target())
        f = res.facts[0]
        assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED
        assert mapper in {h.pid for h in f.other_holders} and f.heirs == {} and len(f.unexplained_ghosts) == 1
        [h] = [h for h in n.audit().gpus[0].holders if h.pid == mapper]
        assert h.inherited_from is None and h.memory_bytes == 0


def test_one_heir_explains_one_ghost():
    """Two dead listed pids and one orphan: one ghost stays unexplained, and the gate refuses."""
    with node() as n:
        ct = n.ct("orphan")
        n.context(2048, n.orphans_leader(ct), _ident(n.jobs(ct)["job-child"]))
        n.context(2048, n.dead_pid(), pinned=True)
        res = n.gate(_stopped_target())
        assert not res.decision.allow and len(res.facts[0].unexplained_ghosts) == 1


def test_in_flight_fd_in_the_target_is_not_clean():
    """The target's job parks its context fd in flight (the context outlives it) while a neighbour's orphan maps the
    device: the ghost was the target's at the first reading, so reset does not say clean (exit 7)."""
    with node() as n:
        target, other = n.ct("own"), n.ct("orphan")
        n.context(1024, n.orphans_leader(other), _ident(n.jobs(other)["job-child"]))  # the neighbour's own orphaned context
        n.context(4096, n.jobs(target)["job-own"], pinned=True)  # lives on after its owner dies
        rep = n.reset(target, timeout=1.0)
        assert rep.outcome == "not clean" and rep.exit_code == E.EXIT_MEMORY_LEFT
        assert rep.after[0].target_ghosts


def test_in_flight_fd_in_a_neighbour_never_stops_the_innocent_target():
    """A neighbour's hidden context (its dead pid listed, no heir) was never the target's: the reset of the target is
    clean once its own memory is back, nothing is stopped, and the diagnosis names the other's leftover."""
    with node() as n:
        target = n.ct("own")
        n.context(1024, n.dead_pid(), pinned=True)
        n.context(4096, n.jobs(target)["job-own"])
        rep = n.reset(target, restart=True, timeout=15.0)  # margin for a loaded machine: clean ends the wait
        assert (rep.outcome, rep.exit_code) == ("clean", E.EXIT_OK), rep.diagnosis
        assert n.calls == [] and not rep.left_stopped
        assert any("was never CT" in d for d, _ in rep.diagnosis)


def test_crowded_gpu_is_clean_shared_and_not_flagged():
    """12 neighbour containers with one context each plus the target: the gap of 13 contexts is more than 64 MiB,
    yet reset of the target is clean at once (no restart), the gate allows a shared start, audit flags nothing."""
    with node() as n:
        neighbours = [n.ct("own") for _ in range(12)]
        for ct in neighbours:
            n.context(1024, n.jobs(ct)["job-own"])
        target = n.ct("own")
        n.context(4096, n.jobs(target)["job-own"])
        rep = n.reset(target, restart=True)
        assert (rep.outcome, rep.exit_code) == ("clean", E.EXIT_OK), rep.diagnosis
        assert n.calls == [] and rep.elapsed < 5.0
        pvelike.destroy_ct(target)  # stopped, as PVE would start it
        res = n.gate(target)
        assert res.decision.allow and res.decision.per_gpu[0] is GateState.SHARED, res.decision.reasons
        assert FlagKind.UNATTRIBUTED not in n.audit().gpus[0].flags


def test_real_leak_of_the_target_is_exit_7_and_refused_by_the_gate():
    """The target's 8 GiB stay allocated after its job died, with no pid listed (a driver leak): reset exits 7, and
    the gate refuses the start onto that GPU."""
    with node() as n:
        target = n.ct("own")
        n.context(8192, n.jobs(target)["job-own"], leaks=True)
        rep = n.reset(target, timeout=1.0)
        assert rep.outcome == "not clean" and rep.exit_code == E.EXIT_MEMORY_LEFT
        pvelike.destroy_ct(target)
        res = n.gate(target)
        assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED


def test_unprivileged_host_cuda_process_is_a_sharer_by_default():
    """An unprivileged user's CUDA job on the host (NVML lists it) no longer blocks every container start on that
    GPU: the gate allows a shared start and names it; gate.host_users = "refuse" restores the refusal."""
    with node() as n:
        job = n.host_mapper(uid=65534)
        n.context(1024, job)
        vmid = _stopped_target()
        res = n.gate(vmid)
        assert res.decision.allow and res.decision.per_gpu[0] is GateState.SHARED
        assert f"pid {job}" in "; ".join(res.decision.reasons)
        res = n.gate(vmid, host_users="refuse")
        assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED


# -- a neighbour's owner dies during the target's reset; a ghost dead before it began ------------------------


def test_neighbour_parking_its_fd_during_the_reset_never_stops_the_target():
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


# -- a double-forked grandchild of a live listed process is no heir ---------------------------------------------

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


def _ct_job(n, script: str, want: set[str], gone: str | None = None) -> int:
    """A container running ``script``; its vmid once the jobs named ``want`` run (and ``gone`` no longer does)."""
    [vmid] = pvelike.claim_vmids(1)
    n.vmids.append(vmid)
    n.cts.append(pvelike.start_ct(vmid, [sys.executable, "-c", script]))
    n._wait(lambda: want <= set(n.jobs(vmid)) and (gone is None or gone not in n.jobs(vmid)), f"CT {vmid}'s job")
    return vmid


def test_double_forked_worker_does_not_absorb_a_stopped_cts_leak():
    """A grandchild of a live listed process (re-parented to the CT's init) is no heir: the gate refuses the ghost."""
    with node() as n:
        ct = _ct_job(n, JOB2, {"job-worker", "job-grand"})
        jobs = n.jobs(ct)
        n.context(1024, jobs["job-worker"], _ident(jobs["job-grand"]))
        n.context(8192, n.dead_pid(), pinned=True)  # the stopped CT's leak
        res = n.gate(_stopped_target())
        assert not res.decision.allow and res.facts[0].heirs == {}, (res.facts[0].heirs, res.decision.reasons)


def test_audit_credits_no_ghost_to_a_double_forked_grandchild():
    """Audit credits no stranger's dead pid to a grandchild of a live listed process."""
    with node() as n:
        ct = _ct_job(n, JOB2, {"job-worker", "job-grand"})
        jobs = n.jobs(ct)
        n.context(1024, jobs["job-worker"], _ident(jobs["job-grand"]))
        n.context(8192, n.dead_pid(), pinned=True)
        row = n.audit().gpus[0]
        assert not any(h.inherited_from for h in row.holders)


# -- an orphan takes its own dead session leader's ghost ------------------------------------------------------

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


def _sid_orphan(n) -> tuple[int, int, tuple[int, int]]:
    """A CT whose session leader died, its fork child lingering: (vmid, child pid, the dead leader's identity)."""
    vmid = _ct_job(n, JOB_SID, {"job-child"}, gone="job-leader")
    child = n.jobs(vmid)["job-child"]
    sid = int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[3])
    assert sid != child
    return vmid, child, (sid, 0)  # start 0: no live process has it (the leader is dead; its pid is kept as the sid)


def test_neighbours_hidden_context_never_stops_a_target_with_an_orphan():
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


# -- NVML lists one row per process, however many contexts --------------------------------------------------------


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


def _forge_session_at(n: Node, ct: int, fifo: str, pid: int, tries: int = 200) -> int:
    """CT ``ct``'s ``forge`` job makes a session whose id is ``pid`` (the kernel's next pid set just before each try,
    as a tenant's pid cycling gets there); returns its holder's pid. Tries whose session got another number end."""
    with open(fifo, "wb", buffering=0) as go:
        for _ in range(tries):
            before = set(pvelike.ct_procs(ct))
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
            go.write(b"x")
            def forged(before: set[int] = before) -> list[int]:
                return [p for p in set(pvelike.ct_procs(ct)) - before if _comm(p) == "job-forged"]

            n._wait(forged, "the forged holder")
            [holder] = forged()
            st = read_stat(holder)
            if st is not None and st.sid == pid:
                return holder
            pvelike.kill_and_reap(holder)
            if os.path.exists(f"/proc/{pid}"):  # another process of this busy machine took the number first
                pytest.skip(f"pid {pid} was taken by another process before the tenant's try")
    raise AssertionError(f"no session with id {pid} after {tries} tries")


def test_a_tenants_session_at_a_dead_pids_number_does_not_absorb_its_memory(tmp_path):
    """A stopped CT's dead listed pid holds 8 GiB and no group or session keeps its number; a neighbour's tenant gets
    that number for a process (pid cycling), calls setsid() there, forks a child that maps the device and lets the
    leader exit: the child's session id is the dead pid's, yet it is no heir (the session was made after the owner
    died, in another container: the stopped CT's post-stop check saw it listed and dead, and the record kept since
    when). The gate refuses the start onto the 8 GiB; audit credits nothing to the tenant."""
    fifo = str(tmp_path / "tries")
    os.mkfifo(fifo)
    with node() as n:
        n.host.record_dir = str(tmp_path / "pids")
        ghost = n.dead_pid()
        n.context(8192, ghost, pinned=True)
        n.gate(_stopped_target())  # the stopped CT's post-stop check
        ct = n.ct("forge", fifo)
        forged = _forge_session_at(n, ct, fifo, ghost[0])
        res = n.gate(_stopped_target())
        assert not res.decision.allow and res.decision.per_gpu[0] is GateState.REFUSED, res.decision.reasons
        assert res.facts[0].heirs == {} and res.facts[0].unexplained_ghosts == [ghost[0]]
        [h] = [h for h in n.audit().gpus[0].holders if h.pid == forged]
        assert h.inherited_from is None and h.memory_bytes == 0
