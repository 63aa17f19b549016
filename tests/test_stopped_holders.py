"""Stopped, traced and frozen GPU holders on real processes in a PVE-like container (cgroup /lxc/<vmid>/ns + a
PID namespace): reset ends each one well inside the grace period instead of waiting for a signal that cannot
be delivered (a frozen holder with a SIGTERM handler gets SIGKILL at once).

The stand-in GPU is the slave of a pseudo-terminal with a high index that this module opens (the test process
keeps only the master, which is another device, so it is never a holder itself); the NVML stand-in lists every
live process holding it, 512 MiB each, and the memory returns when the holder is gone. The two tests of a holder in
a child cgroup the tenant froze run on tests/test_heirs.py's node instead (/dev/zero mapped, the driver model).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.procfs import DeviceTable, ProcHost
from pvegpu.core import errors as E
from pvegpu.core.model import MIB, CtStatus, GpuInfo, GpuSample, Guest, NvmlProcess
from pvegpu.reset import Ports, ResetPolicy, reset
from tests import pvelike
from tests.test_heirs import _ct_job, node

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, PID namespaces, ptrace)")]

GRACE = 6.0  # a reset that waited the grace for a stopped holder takes longer than this; one that did not, far less
FAST = 2.5


@pytest.fixture
def standin() -> Iterator[tuple[str, DeviceTable]]:
    """(path of the stand-in GPU, the table that maps its device number to GPU minor 0)."""
    master, slave = pvelike.high_pty()
    path, rdev = os.ttyname(slave), os.fstat(slave).st_rdev
    os.close(slave)  # only the workloads hold the slave; the master is another device
    try:
        yield path, DeviceTable({(os.major(rdev), os.minor(rdev)): 0})
    finally:
        os.close(master)


class HolderProbe:
    """NVML stand-in: every live holder of the stand-in device in CT ``vmid`` (only its processes can hold this
    test's device, and scanning only them keeps the test fast on a crowded host) is listed with 512 MiB, freed
    when it is gone."""

    def __init__(self, host: ProcHost, vmid: int) -> None:
        self.host, self.vmid = host, vmid

    def gpus(self) -> list[GpuInfo]:
        return [GpuInfo(0, 0, "GPU-standin-0", "0000:00:00.0")]

    def sample(self, minors):
        live = [h.pid for h in self.host.holdings(self.host.ct_pids(self.vmid)).values()
                if 0 in h.minors and (i := self.host.describe(h.pid)) is not None and i.state not in ("Z", "X")]
        return {m: GpuSample(m, len(live) * 512 * MIB, tuple(NvmlProcess(p, 512 * MIB) for p in live)) for m in minors}


class OneCt:
    """PVE with one container granted GPU 0; a power action would fail the test (restart is off)."""

    def __init__(self, vmid: int) -> None:
        self.vmid = vmid

    def local_node(self) -> str:
        return "pve1"

    def where(self, vmid: int) -> Guest | None:
        return Guest(vmid, "pve1", "lxc") if vmid == self.vmid else None

    def guests(self) -> list[Guest]:
        return [Guest(self.vmid, "pve1", "lxc")]

    def ct_config(self, guest: Guest) -> str:
        return "arch: amd64\ndev0: /dev/nvidia0,gid=44\n"

    def ct_status(self, guest: Guest) -> CtStatus:
        return CtStatus("running")

    def ct_stop(self, guest: Guest) -> str:
        raise AssertionError("no power action with restart disabled")

    ct_start = ct_stop


def _vmid() -> int:
    while True:
        vmid = random.randint(600_000, 699_999)
        if not os.path.exists(os.path.dirname(pvelike.cgroup_dir(vmid))):
            return vmid


def _holder_code(dev: str, handler: bool, marker: str) -> str:
    """A holder of the stand-in device; with ``handler``, a SIGTERM handler that writes ``marker`` and exits."""
    code = f"import os, signal, time\nfd = os.open({dev!r}, os.O_RDWR | os.O_NOCTTY)\n"
    if handler:
        code += f"def bye(*_):\n    open({marker!r}, 'w').close()\n    os._exit(0)\nsignal.signal(signal.SIGTERM, bye)\n"
    return code + "while True:\n    time.sleep(3600)\n"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait(cond, what: str, limit: float = 15.0):
    return pvelike.wait_until(cond, what, limit)


@pytest.fixture
def ct(standin, tmp_path):
    """Start a one-holder container: returns (vmid, holder host pid, host); destroyed afterwards."""
    dev, table = standin
    host = ProcHost(table)
    made: list[int] = []

    def start(handler: bool) -> tuple[int, int]:
        vmid = _vmid()
        made.append(vmid)
        pvelike.start_ct(vmid, [sys.executable, "-c", _holder_code(dev, handler, str(tmp_path / "handled"))])
        held = _wait(lambda: host.holdings(host.ct_pids(vmid)), "the holder to open the stand-in device")
        [pid] = held
        return vmid, pid

    yield start, host, tmp_path / "handled"
    for v in made:
        pvelike.destroy_ct(v)


def _reset(vmid: int, host: ProcHost):
    t = time.monotonic()
    rep = reset(vmid, Ports(OneCt(vmid), HolderProbe(host, vmid), host, SystemClock()),
                ResetPolicy(grace=GRACE, kill_wait=3.0, timeout=5.0, settle=0.1, restart=False))
    return rep, time.monotonic() - t


def _signals(rep, pid: int) -> list[str]:
    return [s["signal"] for s in rep.signalled if s["pid"] == pid and s["result"] == "sent"]


@pytest.mark.parametrize("handler", [True, False], ids=["with-handler", "default-action"])
def test_stopped_holder_gets_sigcont_after_sigterm_and_ends_at_once(ct, handler):
    """A SIGSTOPped holder (state T) gets SIGTERM then SIGCONT: its handler runs (or SIGTERM's default action
    ends it) and reset is clean well inside the grace, with no SIGKILL."""
    start, host, marker = ct
    vmid, pid = start(handler)
    os.kill(pid, signal.SIGSTOP)
    _wait(lambda: _state(pid) == "T", "the holder to stop")
    rep, took = _reset(vmid, host)
    assert rep.outcome == "clean" and rep.exit_code == 0, rep.diagnosis
    assert took < FAST, f"reset took {took:.2f} s: it waited for a stopped holder"
    assert _signals(rep, pid) == ["SIGTERM", "SIGCONT"]
    assert marker.exists() is handler  # the handler ran: the process ended cleanly, not by SIGKILL


def test_traced_holder_gets_sigkill_at_once(ct):
    """A holder stopped by a tracer (state t: SIGCONT cannot resume it) gets SIGKILL at once, not after the grace."""
    start, host, _marker = ct
    vmid, pid = start(True)
    tracer = subprocess.Popen([sys.executable, "-c", (
        "import ctypes, os, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\npid = int(sys.argv[1])\n"
        "assert libc.ptrace(16, pid, None, None) == 0, ctypes.get_errno()\nos.waitpid(pid, 0)\n"
        "print('attached', flush=True)\ntime.sleep(60)\n"), str(pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout is not None and tracer.stdout.readline().strip() == "attached"
        _wait(lambda: _state(pid) == "t", "the holder to be trace-stopped")
        assert host.describe(pid).term_futile  # TracerPid is set: SIGTERM would go to the tracer first
        rep, took = _reset(vmid, host)
        assert rep.outcome == "clean" and rep.exit_code == 0, rep.diagnosis
        assert took < FAST, f"reset took {took:.2f} s: it waited for a traced holder"
        assert _signals(rep, pid) == ["SIGKILL"]
    finally:
        tracer.kill()
        tracer.wait()


def test_holder_in_a_frozen_cgroup_is_stopped_at_once(ct):
    """A holder in a frozen cgroup (cgroup.freeze = 1; it shows state S, not T) still ends inside the grace."""
    start, host, _marker = ct
    vmid, pid = start(False)
    freeze = os.path.join(pvelike.cgroup_dir(vmid), "cgroup.freeze")
    if not os.path.exists(freeze):
        pytest.skip("this kernel has no cgroup v2 freezer")
    with open(freeze, "w") as f:
        f.write("1")
    with open(os.path.join(pvelike.cgroup_dir(vmid), "cgroup.events")) as f:
        _wait(lambda: "frozen 1" in open(f.name).read(), "the cgroup to freeze")
    assert _state(pid) != "T"
    rep, took = _reset(vmid, host)
    assert rep.outcome == "clean" and rep.exit_code == 0, rep.diagnosis
    assert took < FAST, f"reset took {took:.2f} s for a frozen holder"


def test_tracer_pid_makes_sigterm_futile():
    """``TracerPid`` other than 0 in /proc/<pid>/status marks SIGTERM futile (a debugger sees it first)."""
    from pvegpu.adapters.procfs import term_futile

    base = b"Name:\tx\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000004000\n"
    assert term_futile(base + b"TracerPid:\t4242\n", [100, 5])
    assert not term_futile(base + b"TracerPid:\t0\n", [100, 5])


def test_dry_run_says_what_a_stopped_or_traced_holder_will_get(ct):
    """--dry-run names SIGCONT for a stopped holder; nothing is signalled and the holder stays stopped."""
    start, host, _marker = ct
    vmid, pid = start(False)
    os.kill(pid, signal.SIGSTOP)
    _wait(lambda: _state(pid) == "T", "the holder to stop")
    rep = reset(vmid, Ports(OneCt(vmid), HolderProbe(host, vmid), host, SystemClock()), ResetPolicy(dry_run=True, restart=False))
    (plan,) = [p for p in rep.plan if p["pid"] == pid]
    assert "SIGCONT" in plan["action"] and rep.signalled == [] and _state(pid) == "T"


# -- a holder in a cgroup the tenant froze, on the heirs' node (tests/test_heirs.py) --------------------------

# A holder with a clean-shutdown handler for SIGTERM, as most services have.
JOB3 = r"""
import mmap, os, signal, time
fd = os.open('/dev/zero', os.O_RDWR); m = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
open('/proc/self/comm','w').write('job-handler')
time.sleep(300)
"""


def _freeze(vmid: int, pid: int) -> None:
    """Move ``pid`` into a child cgroup of CT ``vmid``'s and freeze that (cgroup.freeze = 1), as a tenant may."""
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


def test_frozen_holder_is_stopped_well_within_the_grace():
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
