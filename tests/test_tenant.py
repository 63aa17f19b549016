"""What a tenant can do to the host adapter, on real processes, cgroups and PID namespaces:
nested containers, forged cgroup names, a dead main thread, files named like GPUs, scan blow-ups (and a bug in the
reader: that process unknown, the scan goes on), a stalled maps read, a thread with its own fd table, hostile text."""

from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.adapters.procfs import DeviceTable, ProcessScan, ProcHost, ScanBudget
from pvegpu.core.model import Holding, Place, Placement, SignalResult
from tests import pvelike
from tests.test_scan_ahead import _table

ZERO = os.stat("/dev/zero").st_rdev
_MASTER, GPU, GPU_RDEV = pvelike.private_device()  # this run's own device number stands in for /dev/nvidia0
TABLE = DeviceTable({(os.major(GPU_RDEV), os.minor(GPU_RDEV)): 0})
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, PID namespaces)")
HOLD = f"import os,sys,time; fd=os.open({GPU!r}, os.O_RDONLY | os.O_NOCTTY); print('ok', flush=True); time.sleep(120)"


def _vmid() -> int:
    """A vmid no other test run uses at the same time (its cgroup must not exist yet)."""
    while True:
        vmid = random.randint(700_000, 799_999)
        if not os.path.exists(os.path.dirname(pvelike.cgroup_dir(vmid))):
            return vmid


def _wait(cond, what: str, limit: float = 10.0):
    return pvelike.wait_until(cond, what, limit)


def _gone(host: ProcHost, ident) -> bool:
    return not host.alive(ident)


@pytest.mark.root
@root
def test_nested_pid_namespace_init_is_payload_and_ct_pid_is_the_containers():
    """PID 1 of a namespace nested in the CT (unshare --pid --fork inside) is signalled; its CT pid is shown; the CT init is refused."""
    vmid = _vmid()
    ct = pvelike.start_ct(vmid, ["unshare", "--pid", "--fork", sys.executable, "-c", HOLD])
    try:
        host = ProcHost(TABLE)
        held = _wait(lambda: host.holdings(host.ct_pids(vmid)), "the nested holder")
        [pid] = held
        info = host.describe(pid)
        with open(f"/proc/{pid}/status") as f:
            nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        assert len(nspid) == 3 and nspid[-1] == "1"  # host pid, CT pid, nested pid 1
        assert not info.is_ct_init and info.ns_pid == int(nspid[1]) != 1
        [init] = [i for p in host.ct_pids(vmid) if (i := host.describe(p)).is_ct_init]
        assert init.ns_pid == 1
        assert host.signal(init.ident, signal.SIGKILL, vmid) is SignalResult.REFUSED
        assert host.signal(info.ident, signal.SIGTERM, vmid) is SignalResult.SENT  # a nested init ignores it (no handler)
        assert host.signal(info.ident, signal.SIGKILL, vmid) is SignalResult.SENT  # so reset's escalation ends it
        _wait(lambda: _gone(host, info.ident), "the nested holder to exit")
        assert host.alive(init.ident)
    finally:
        pvelike.destroy_ct(vmid)
        ct.wait(5)


@pytest.mark.root
@root
@pytest.mark.parametrize("brk", ["\r", "\x0b", "\x0c", "\x1c", "\x1e", "\u0085"])
def test_forged_cgroup_name_keeps_the_process_in_its_container(brk):
    """A holder in a nested cgroup named 'x<brk>0::/lxc.monitor/730' is still in its CT: listed, signalled, name escaped."""
    vmid = _vmid()
    forged = os.path.join(pvelike.cgroup_dir(vmid), f"x{brk}0::", "lxc.monitor", "730")
    os.makedirs(forged)

    def enter() -> None:
        with open(os.path.join(forged, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    p = subprocess.Popen([sys.executable, "-c", HOLD], preexec_fn=enter, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        host = ProcHost(TABLE)
        info = host.describe(p.pid)
        assert info.placement == Placement(Place.CONTAINER, vmid)
        assert p.pid in host.ct_pids(vmid) and host.holdings([p.pid])[p.pid].minors == {0}
        assert brk not in info.cgroup and info.cgroup.isprintable() and "lxc.monitor/730" in info.cgroup
        assert host.signal(info.ident, signal.SIGKILL, vmid) is SignalResult.SENT
        p.wait(10)
    finally:
        p.kill()
        p.wait()
        pvelike.destroy_ct(vmid)


def test_unreadable_cgroup_is_unknown_never_host(tmp_path):
    """A process whose /proc/<pid>/cgroup cannot be read is placed UNKNOWN, and is never signalled."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_bytes(stat)
    (tmp_path / "4242" / "status").write_bytes(b"Name:\tx\nUid:\t0\t0\t0\t0\nNSpid:\t4242\n")
    info = ProcHost(TABLE, proc=str(tmp_path)).describe(4242)
    assert info.placement.place is Place.UNKNOWN and not info.is_ct_init


def test_member_with_unreadable_placement_stays_listed_but_is_never_signalled(tmp_path):
    """A pid the CT's cgroupfs lists whose /proc/<pid>/cgroup cannot be read is kept in ct_pids as UNKNOWN, never signalled."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (cg / "lxc" / "777" / "ns").mkdir(parents=True)
    (cg / "cgroup.procs").write_text("")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (cg / "lxc" / "777" / "ns" / "cgroup.procs").write_text(f"{p.pid}\n")
        (proc / str(p.pid)).mkdir(parents=True)
        with open(f"/proc/{p.pid}/stat", "rb") as f:
            (proc / str(p.pid) / "stat").write_bytes(f.read())
        host = ProcHost(TABLE, proc=str(proc), cgroup_root=str(cg))
        assert host.ct_pids(777) == [p.pid] and host.describe(p.pid).placement.place is Place.UNKNOWN
        assert host.signal(host.describe(p.pid).ident, signal.SIGKILL, 777) is SignalResult.MOVED
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


_THREAD_HOLDER = r"""
import ctypes, os, threading, time
fd = os.open({gpu!r}, os.O_RDONLY | os.O_NOCTTY)
threading.Thread(target=lambda: time.sleep(120)).start()
print('ok', flush=True)
ctypes.CDLL(None).syscall({nr}, 0)  # SYS_exit: only the main thread ends; the leader becomes Z
"""


@pytest.mark.root
@root
def test_process_whose_main_thread_exited_is_a_live_holder():
    """Leader Z with a live thread: not a zombie, alive, holds via its threads' fds, and SIGTERM through the pidfd ends it."""
    nr = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)
    if nr is None:
        pytest.skip("SYS_exit number unknown for this architecture")
    vmid = _vmid()
    cg = pvelike.cgroup_dir(vmid)
    os.makedirs(cg)

    def enter() -> None:
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    p = subprocess.Popen([sys.executable, "-c", _THREAD_HOLDER.format(nr=nr, gpu=GPU)], preexec_fn=enter, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        host = ProcHost(TABLE)
        _wait(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", "the main thread to exit")
        info = host.describe(p.pid)
        assert info.state not in ("Z", "X") and host.alive(info.ident)
        assert p.pid in host.ct_pids(vmid)
        held = host.holdings([p.pid])[p.pid]
        assert held.minors == {0} and "fd" in held.via
        assert host.signal(info.ident, signal.SIGTERM, vmid) is SignalResult.SENT
        p.wait(10)
        assert not host.alive(info.ident)
    finally:
        p.kill()
        p.wait()
        pvelike.destroy_ct(vmid)


_MAPPED_THREAD_HOLDER = r"""
import ctypes, os, threading, time
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open('/dev/zero', os.O_RDWR)
assert libc.mmap(None, 4096, 3, 2, fd, 0) not in (None, 2**64 - 1)
os.close(fd)  # mapped only
threading.Thread(target=lambda: time.sleep(120)).start()
print('ok', flush=True)
libc.syscall({nr}, 0)
"""


def test_mapping_of_a_process_whose_main_thread_exited_is_unknown_not_nothing():
    """With the leader gone, map_files cannot prove a mapping: the process is 'unreadable', never 'holds nothing'."""
    nr = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)
    if nr is None:
        pytest.skip("SYS_exit number unknown for this architecture")
    p = subprocess.Popen([sys.executable, "-c", _MAPPED_THREAD_HOLDER.format(nr=nr)], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        _wait(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", "the main thread to exit")
        host = ProcHost(DeviceTable({(os.major(ZERO), os.minor(ZERO)): 2}))
        assert host.alive(host.describe(p.pid).ident)
        assert "unreadable" in host.holdings([p.pid])[p.pid].via
    finally:
        p.kill()
        p.wait()


_MAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR)
    assert libc.mmap(None, 4096, 3, 2, fd, 0) not in (None, 2**64 - 1)  # PROT_READ|WRITE, MAP_PRIVATE
    os.close(fd)  # mapped only: no fd left to find
print('ok', flush=True)
time.sleep(120)
"""


def _mapper(*paths: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _MAPPER, *paths], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ok"
    return p


@pytest.mark.map_files
def test_mapped_device_found_by_device_number():
    """A process that only maps the stand-in device (fd closed) is a holder via maps, by st_rdev."""
    p = _mapper("/dev/zero")
    try:
        host = ProcHost(DeviceTable({(os.major(ZERO), os.minor(ZERO)): 2}))
        held = host.holdings([p.pid])[p.pid]
        assert held.minors == {2} and held.via == {"maps"}
    finally:
        p.kill()
        p.wait()


@pytest.mark.map_files
def test_files_named_like_gpus_are_not_holders(tmp_path):
    """Mapped plain files named /dev/nvidia7 or '... /dev/nvidia3' hold no GPU."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "x " / "dev").mkdir(parents=True)
    paths = [str(tmp_path / "dev" / "nvidia7"), str(tmp_path / "x /dev" / "nvidia3")]
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"\0" * mmap.PAGESIZE)
    p = _mapper(*paths)
    try:
        assert p.pid not in ProcHost(DeviceTable(control=frozenset())).holdings([p.pid])
    finally:
        p.kill()
        p.wait()


def test_over_budget_process_is_unknown_and_the_scan_goes_on():
    """A process over the fd budget is reported unreadable ('budget') while another holder in the same scan is still found."""
    many = subprocess.Popen([sys.executable, "-c", "import os,time; fds=[os.open('/dev/null', 0) for _ in range(300)]; "
                             "print('ok', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    assert many.stdout.readline().strip() == b"ok"
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"ok"
    try:
        held = ProcHost(TABLE, budget=ScanBudget(fds=100)).holdings([many.pid, holder.pid])
        assert held[many.pid].via == {"unreadable", "budget"}
        assert held[holder.pid].minors == {0} and held[holder.pid].via == {"fd"}
        lines = ProcHost(TABLE, budget=ScanBudget(map_lines=10)).holdings([many.pid])
        assert lines[many.pid].via == {"unreadable", "budget"}  # no GPU fd, so maps were read: too many lines
    finally:
        for p in (many, holder):
            p.kill()
            p.wait()


class _Boom(ProcessScan):
    """A scan of one process that raises (a bug in the reader), for pid ``bad`` only."""

    bad = -1

    def run(self, proc, pid, deep=False):  # noqa: ANN001, ANN201 - the ProcessScan signature
        if pid == self.bad:
            raise ZeroDivisionError("a bug in the scan")
        return Holding(pid, frozenset({0}), frozenset({"fd"}))


def test_a_process_whose_reading_raises_is_unreadable_and_the_scan_goes_on(tmp_path, monkeypatch):
    """A bug reading one process makes it unreadable (unknown), the others are still read, nothing raised (PVEGPU_DEBUG=1 raises)."""
    monkeypatch.delenv("PVEGPU_DEBUG", raising=False)
    _Boom.bad = 2
    host = ProcHost(proc=str(tmp_path), scan=_Boom, workers=1)
    got = host.holdings([1, 2, 3])
    assert got[1].minors == {0} and got[3].minors == {0}
    assert "unreadable" in got[2].via and not got[2].minors
    monkeypatch.setenv("PVEGPU_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        ProcHost(proc=str(tmp_path), scan=_Boom, workers=1).holdings([1, 2, 3])


def test_a_gpu_fd_holder_whose_maps_read_stalls_keeps_its_gpu_in_a_deep_scan(tmp_path):
    """A holder proven by its GPU fd whose maps read then blocks (mm lock wedged: a FIFO here) keeps GPU 0 in a deep scan."""
    pid = 8200
    d = tmp_path / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_bytes(b"%d (job) S 1 0 0 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0 0\n" % pid)
    (d / "fd" / "3").symlink_to("/dev/full")
    fifo = str(d / "maps")
    os.mkfifo(fifo)
    try:
        assert ProcHost(_table(), proc=str(tmp_path), workers=1).holdings([pid])[pid].minors == {0}  # not deep: proven
        got = ProcHost(_table(), proc=str(tmp_path), workers=1).holdings([pid], deep=True)
        assert 0 in got[pid].minors, got[pid]
    finally:
        for _ in range(3):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


_PRIVATE_TABLE = r"""
import ctypes, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def hold():
    assert libc.unshare(0x400) == 0  # CLONE_FILES: this thread's own fd table, the leader's is left as it was
    os.open('/dev/full', os.O_RDONLY)  # the stand-in GPU, by fd only (no mapping)
    print('ok', flush=True)
    time.sleep(60)
threading.Thread(target=hold, daemon=True).start()
time.sleep(60)
"""


@pytest.mark.root(reason="needs root: a user's scan cannot prove mappings (map_files), so every process reads as unknown")
@pytest.mark.xfail(strict=True, reason="known gap (closing note): only the leader's fd table is read; a CUDA context in any "
                   "thread still shows in the shared maps, so only an fd-only handle (no GPU memory) goes unseen")
def test_a_thread_with_its_own_fd_table_cannot_hide_a_gpu_fd():
    """A thread that unshares its fd table and opens the GPU there is a holder (or unknown), though the leader's table shows none."""
    p = subprocess.Popen([sys.executable, "-c", _PRIVATE_TABLE], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        held = ProcHost(_table(), workers=1).holdings([p.pid], deep=True)
        assert p.pid in held and (0 in held[p.pid].minors or "unreadable" in held[p.pid].via), held
    finally:
        p.kill()
        p.wait()

def test_tenant_text_is_escaped_and_new_fields_filled():
    """comm and cmdline with terminal escapes come back escaped (printable); ppid, uid and cmdline are filled."""
    code = "import sys,time; open('/proc/self/comm','w').write('\\x1b[2Jx\\ry'); print('ok', flush=True); time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", code, "\x1b]0;pwned\x07", "\u202eevil"], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        info = ProcHost(TABLE).describe(p.pid)
        assert info.comm == "\\x1b[2Jx\\x0dy"
        assert info.cmdline.endswith("\\x1b]0;pwned\\x07 \\u202eevil") and info.cmdline.isprintable()
        assert info.ppid == os.getpid() and info.uid == os.getuid()
    finally:
        p.kill()
        p.wait()


def test_sigterm_futility_read_from_status():
    """A process that ignores SIGTERM is marked term_futile (SIGKILL need not wait); a plain one is not."""
    ign = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE)
    plain = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert ign.stdout is not None and plain.stdout is not None
        ign.stdout.readline()
        plain.stdout.readline()
        host = ProcHost(DeviceTable({}))
        assert host.describe(ign.pid).term_futile and not host.describe(plain.pid).term_futile
    finally:
        for p in (ign, plain):
            p.kill()
            p.wait()


def test_nested_namespace_init_without_handler_is_term_futile():
    """PID 1 of a nested PID namespace without a SIGTERM handler cannot get SIGTERM from the host: term_futile."""
    from pvegpu.adapters.procfs import term_futile

    status = b"Name:\tpython\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000000002\n"
    assert term_futile(status, [5000, 40, 1]) and not term_futile(status, [5000, 40]) and not term_futile(status, [5000, 1])
    handled = status.replace(b"0000000000000002", b"0000000000004002")
    assert not term_futile(handled, [5000, 40, 1])


FUSE_HOLDER = r"""
import ctypes, os, sys, time
gpu = os.open(sys.argv[1], os.O_RDONLY)
mnt = sys.argv[2]
fuse = os.open("/dev/fuse", os.O_RDWR)
libc = ctypes.CDLL(None, use_errno=True)
if libc.mount(b"hang", mnt.encode(), b"fuse", 0, f"fd={fuse},rootmode=40000,user_id=0,group_id=0".encode()) != 0:
    print("mount failed", flush=True); sys.exit(1)
root = os.open(mnt, os.O_PATH)   # an fd into a mount whose daemon (this process) never answers
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse")
def test_hung_fuse_mount_cannot_hang_the_scan(tmp_path):
    """A process with an fd on a FUSE mount that never answers is read without asking the server: its GPU fd is
    found at once, and the other processes are scanned as usual (more in test_fuse_scan)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", FUSE_HOLDER, "/dev/zero", str(mnt)],
                         stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, "-c", "import os, time; fd = os.open('/dev/zero', 0); print(1, flush=True); time.sleep(120)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and plain.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        plain.stdout.readline()
        host = ProcHost(DeviceTable({(os.major(ZERO), os.minor(ZERO)): 0}))
        t = time.monotonic()
        held = host.holdings([p.pid, plain.pid])
        assert time.monotonic() - t < 1
        assert held[p.pid].minors == {0} and "unreadable" not in held[p.pid].via and held[plain.pid].minors == {0}
    finally:
        for q in (p, plain):
            q.kill()
            q.wait()


@pytest.mark.root
@root
def test_member_in_a_cgroup_deeper_than_path_max_is_listed():
    """A tenant nests cgroups past PATH_MAX: a process at the bottom is still one of the CT's processes (the gate sees it)."""
    vmid = _vmid()
    ct = pvelike.start_ct(vmid, ["sleep", "120"])
    deep_proc = None
    try:
        host = ProcHost(TABLE)
        _wait(lambda: host.ct_pids(vmid), "the container")
        fd = os.open(pvelike.cgroup_dir(vmid), os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(18):  # 18 x 250 characters > 4096
            os.mkdir("d" * 250, dir_fd=fd)
            nfd = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=fd)
        r, w = os.pipe()
        deep_proc = subprocess.Popen(["sleep", "120"], pass_fds=(r,), preexec_fn=lambda: (os.write(procs, str(os.getpid()).encode())))
        os.close(procs)
        os.close(fd)
        assert deep_proc.pid in host.ct_pids(vmid)
    finally:
        if deep_proc is not None:
            deep_proc.kill()
            deep_proc.wait()
        pvelike.destroy_ct(vmid)
        ct.wait(5)
