"""A FUSE server that never answers, on real processes, as a local user makes one: the scan is bounded in total,
never waits on the server, and pvegpu stays killable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.adapters.procfs import DeviceTable, ProcHost, ScanBudget
from pvegpu.core.holders import inspect_gpus
from pvegpu.core.model import GpuInfo, GpuSample
from tests import pvelike

ZERO = os.stat("/dev/zero").st_rdev
TABLE = DeviceTable({(os.major(ZERO), os.minor(ZERO)): 0})  # /dev/zero stands in for /dev/nvidia0
NOBODY = 65534

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                                   reason="needs root and /dev/fuse")]

# A FUSE daemon as `fusermount3 -o allow_other` leaves it for a local user: mounted nodev,nosuid with the user's
# uid, the daemon then running as that user. It answers INIT, then reads every request and never answers one:
# a request it has read can no longer be interrupted, so whoever asked waits in the kernel, even past SIGKILL.
DAEMON = r"""
import ctypes, os, struct, sys, threading, time
mnt, cgroup, gpu = sys.argv[1], sys.argv[2], sys.argv[3]
forks = int(sys.argv[4]) if len(sys.argv) > 4 else 0
libc = ctypes.CDLL(None, use_errno=True)
if cgroup != "-":
    with open(cgroup, "w") as f:
        f.write(str(os.getpid()))
if libc.unshare(0x00020000) != 0 or libc.mount(None, b"/", None, 0x4000 | 0x40000, None) != 0:
    print("unshare failed", flush=True); sys.exit(1)
fuse = os.open("/dev/fuse", os.O_RDWR)
opts = f"fd={fuse},rootmode=40000,user_id=65534,group_id=65534,allow_other".encode()
if libc.mount(b"hang", mnt.encode(), b"fuse.hang", 2 | 4, opts) != 0:
    print("mount failed", ctypes.get_errno(), flush=True); sys.exit(1)
held = os.open(gpu, os.O_RDONLY)
root = os.open(mnt, os.O_PATH)  # an fd on the mount whose server never answers (an O_PATH open asks it nothing)
os.setgroups([]); os.setgid(65534); os.setuid(65534)

def serve():
    while True:
        req = os.read(fuse, 1 << 20)
        size, opcode, unique = struct.unpack_from("<IIQ", req)
        if opcode == 26:  # INIT: the only answer this server ever gives
            body = struct.pack("<IIIIHHI", 7, 31, 0, 0, 0, 0, 4096)
            os.write(fuse, struct.pack("<IiQ", 16 + len(body), 0, unique) + body)

threading.Thread(target=serve, daemon=True).start()
time.sleep(0.2)
kids = []
for _ in range(forks):  # more processes holding an fd on the same mount (the server stays this one)
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    kids.append(pid)
print("ready", *kids, flush=True)
time.sleep(300)
"""

SCANNER = r"""
import os, sys
from pvegpu.adapters.procfs import DeviceTable, ProcHost
zero = os.stat("/dev/zero").st_rdev
host = ProcHost(DeviceTable({(os.major(zero), os.minor(zero)): 0}))
pids = [int(p) for p in sys.argv[1:]]
host.holdings(pids)
print("scanned", flush=True)
host.holdings(pids)
print("scanned", flush=True)
import time; time.sleep(300)
"""


def _daemons(tmp_path, n: int, cgroup: str = "-") -> list[subprocess.Popen[str]]:
    procs = []
    for i in range(n):
        mnt = tmp_path / f"m{i}"
        mnt.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-c", DAEMON, str(mnt), cgroup, "/dev/zero"], stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def _blocking_stat(path: str) -> tuple[int, int]:
    """A plain stat, which asks the FUSE server (what the scan did before)."""
    st = os.stat(path)
    return st.st_mode, st.st_rdev


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(10)


@pytest.fixture
def eight(tmp_path):
    procs = _daemons(tmp_path, 8)
    yield procs
    _stop(procs)


def test_fuse_server_that_never_answers_costs_the_scan_nothing(eight):
    """8 processes with fds on a FUSE mount that never answers: every one is read exactly (its GPU fd found), at once."""
    host = ProcHost(TABLE)
    t = time.monotonic()
    held = host.holdings([p.pid for p in eight])
    assert time.monotonic() - t < 1.5
    assert all(held[p.pid].minors == {0} and "unreadable" not in held[p.pid].via for p in eight)


def test_scan_that_blocks_in_the_kernel_is_bounded_in_total(eight):
    """Where a stat does wait on the server (a plain stat, as before), 8 stuck processes cost the scan's total budget,
    not 8 x the per-process one, and each is unknown (unreadable), never 'holds nothing'."""
    host = ProcHost(TABLE, budget=ScanBudget(total=1.5), stat_of=_blocking_stat)
    t = time.monotonic()
    held = host.holdings([p.pid for p in eight])
    assert time.monotonic() - t < 1.5 + 1.0
    assert all("unreadable" in held[p.pid].via for p in eight)


def test_seventy_stuck_processes_cost_one_total_budget(tmp_path):
    """70 processes stuck on a never-answering FUSE mount (a blocking stat): the whole scan, as audit's, ends at its total
    bound (here 3 s; audit's is 15 s in a 50 s unit), never 70 x 0.75 s, and every one of them is unknown."""
    mnt = tmp_path / "m"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, str(mnt), "-", "/dev/zero", "69"], stdout=subprocess.PIPE, text=True)
    pids = [daemon.pid]
    try:
        assert daemon.stdout is not None
        words = daemon.stdout.readline().split()
        assert words[0] == "ready"
        pids += map(int, words[1:])
        host = ProcHost(TABLE, budget=ScanBudget(total=3.0), stat_of=_blocking_stat)
        t = time.monotonic()
        held = host.holdings(pids)
        assert time.monotonic() - t < 3.0 + 1.5
        assert len(pids) == 70 and all("unreadable" in held[p].via for p in pids)
    finally:
        for pid in pids[1:]:  # the forked holders (they keep the FUSE connection open too), by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon.kill()
        daemon.wait(10)


def test_gate_facts_with_eight_stuck_holders_in_the_container_are_unknown_within_the_deadline(tmp_path):
    """8 stuck processes in the target CT (scan that blocks, gate's total budget): the GPU's facts name them all as
    unreadable well within the gate's 5 s deadline, so the gate refuses as unknown instead of timing out."""
    vmid = pvelike.claim_vmids(1)[0]
    cg = pvelike.cgroup_dir(vmid)
    os.makedirs(cg, exist_ok=True)
    procs = _daemons(tmp_path, 8, os.path.join(cg, "cgroup.procs"))
    try:
        host = ProcHost(TABLE, budget=ScanBudget(total=5.0 * 0.3), stat_of=_blocking_stat)

        class Probe:
            def sample(self, minors):
                return {m: GpuSample(m, 0, ()) for m in minors}

        t = time.monotonic()
        facts = inspect_gpus(vmid, [GpuInfo(0, 0, "GPU-0", "0000:01:00.0")], host=host, probe=Probe())
        assert time.monotonic() - t < 5.0
        assert sorted(facts[0].unreadable) == sorted(p.pid for p in procs)
    finally:
        _stop(procs)
        pvelike.destroy_ct(vmid)
        pvelike.release_vmid(vmid)


def test_pvegpu_stays_killable_after_scanning_a_hung_fuse_mount(eight):
    """A pvegpu process that scanned 8 holders on a never-answering FUSE mount dies at once on SIGKILL: none of its
    threads is left waiting in the kernel for the server."""
    env = dict(os.environ, PYTHONPATH=pvelike.REPO)
    scanner = subprocess.Popen([sys.executable, "-c", SCANNER, *[str(p.pid) for p in eight]], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert scanner.stdout is not None
        assert scanner.stdout.readline().strip() == "scanned"
        assert scanner.stdout.readline().strip() == "scanned"
        scanner.kill()
        scanner.wait(3)  # a thread stuck in a FUSE request would keep the process from dying
    finally:
        if scanner.poll() is None:
            _stop(eight)  # aborting the connections frees it
            scanner.wait(10)
