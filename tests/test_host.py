"""The /proc host adapter on real processes: fd holders by device number, PID namespaces, cgroups (a frozen one read
from cgroup.events), pidfd safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pvegpu.adapters.procfs import DeviceTable, ProcHost, cgroup_frozen
from pvegpu.core.model import Place, ProcIdentity
from tests import pvelike

FULL = os.stat("/dev/full").st_rdev
_MASTER, GPU, GPU_RDEV = pvelike.private_device()  # this run's own device number stands in for /dev/nvidia0
TABLE = DeviceTable({(os.major(GPU_RDEV), os.minor(GPU_RDEV)): 0})
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, PID namespaces)")


def _holder(path: str = GPU) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", f"import os,time; fd=os.open({path!r}, os.O_RDONLY | os.O_NOCTTY); print('ok', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ok"
    return p


@pytest.mark.map_files
def test_fd_holder_found_by_device_number():
    """A process holding the stand-in device is found by st_rdev; one holding another device is not."""
    a, b = _holder(), _holder("/dev/null")
    try:
        held = ProcHost(TABLE).holdings([a.pid, b.pid])
        assert held[a.pid].minors == {0} and "fd" in held[a.pid].via
        assert b.pid not in held
    finally:
        a.kill(), b.kill()


@pytest.mark.root
def test_mknod_copy_matches_like_the_original(tmp_path):
    """A mknod copy (what PVE's devN makes) has another inode but the same rdev, so it matches. (Of /dev/full: a
    copy of a pty outside devpts does not open; only this test's own holder is scanned, so others do not matter.)"""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    node = tmp_path / "nvidia0"
    os.mknod(node, 0o666 | 0o020000, FULL)
    p = _holder(str(node))
    try:
        assert ProcHost(DeviceTable({(os.major(FULL), os.minor(FULL)): 0})).holdings([p.pid])[p.pid].minors == {0}
    finally:
        p.kill()


@pytest.fixture
def sleeper():
    """A plain host process that must never be signalled."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_recycled_identity_is_never_signalled(sleeper):
    """A stale identity (same pid, other start time) is 'gone' and the live process gets no signal."""
    host = ProcHost(TABLE)
    stale = ProcIdentity(sleeper.pid, host.describe(sleeper.pid).ident.start_ticks - 1)
    assert host.signal(stale, signal.SIGKILL, 129) == "gone"
    assert sleeper.poll() is None


def test_process_outside_the_container_is_never_signalled(sleeper):
    """A host process is 'moved' for any container and survives."""
    host = ProcHost(TABLE)
    assert host.signal(host.describe(sleeper.pid).ident, signal.SIGKILL, 129) == "moved"
    time.sleep(0.05)
    assert sleeper.poll() is None


def test_self_is_never_a_holder():
    """pvegpu's own process is excluded from the scan even while it holds the device."""
    fd = os.open(GPU, os.O_RDONLY | os.O_NOCTTY)
    try:
        assert os.getpid() not in ProcHost(TABLE).holdings([os.getpid()])
    finally:
        os.close(fd)


@pytest.mark.root
@root
def test_pid_namespace_and_cgroup_container():
    """A process in /lxc/<vmid>/ns and its own PID namespace is placed in the CT, its init recognised (ct_init names
    it), its holders signalled through the pidfd, and the init never."""
    vmid = pvelike.claim_vmids(1)[0]  # this run's own cgroup name
    ct = pvelike.start_ct(vmid, [sys.executable, "-c", f"import os,time; fd=os.open({GPU!r}, os.O_RDONLY | os.O_NOCTTY); time.sleep(60)"])
    try:
        host = ProcHost(TABLE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not host.holdings(host.ct_pids(vmid)):
            time.sleep(0.05)
        pids = host.ct_pids(vmid)
        infos = [host.describe(p) for p in pids]
        assert all(i.placement.place is Place.CONTAINER and i.placement.vmid == vmid for i in infos)
        init = [i for i in infos if i.is_ct_init]
        assert len(init) == 1 and init[0].ns_pid == 1
        assert host.ct_init(vmid) == init[0].pid and host.ct_init(vmid + 1_000_000) is None
        held = host.holdings(pids)
        [holder] = [host.describe(p) for p in held]
        assert holder.ns_pid not in (None, holder.pid)  # NSpid: host pid and container pid differ
        assert host.signal(init[0].ident, signal.SIGKILL, vmid) == "refused"
        assert host.signal(holder.ident, signal.SIGTERM, vmid) == "sent"
        end = time.monotonic() + 5
        while host.alive(holder.ident) and time.monotonic() < end:
            time.sleep(0.02)
        assert not host.alive(holder.ident) and host.alive(init[0].ident)
    finally:
        pvelike.destroy_ct(vmid)
        ct.wait(5)
        pvelike.release_vmid(vmid)


def test_device_table_classifies_nvidia_numbers(tmp_path):
    """195:N is GPU N, 195:254/255 and the dynamic nvidia-uvm/caps majors are control nodes, others nothing."""
    from pvegpu.adapters.procfs import DeviceTable
    from pvegpu.core.model import CONTROL

    (tmp_path / "devices").write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n511 nvidia-caps\n")
    t = DeviceTable(proc=str(tmp_path))
    assert [t.gpu_minor(os.makedev(195, m)) for m in (0, 7, 254, 255)] == [0, 7, CONTROL, CONTROL]
    assert t.gpu_minor(os.makedev(508, 0)) == CONTROL and t.gpu_minor(os.makedev(511, 1)) == CONTROL
    assert t.gpu_minor(os.makedev(1, 7)) is None


def test_maps_only_holder_found(tmp_path):
    """A process with GPU nodes only mapped (no fd) is found through maps + map_files by device number;
    a mapped plain file whose path reads /dev/nvidia5 is not."""
    from pvegpu.core.model import CONTROL

    zero, null = os.stat("/dev/zero").st_rdev, os.stat("/dev/null").st_rdev
    table = DeviceTable({(os.major(FULL), os.minor(FULL)): 3, (os.major(zero), os.minor(zero)): CONTROL,
                         (os.major(null), os.minor(null)): CONTROL})
    pid = tmp_path / "4242"
    (pid / "fd").mkdir(parents=True)
    (pid / "map_files").mkdir()
    fake = tmp_path / "nvidia5"
    fake.write_bytes(b"x")
    ranges = {"7f0000000000-7f0000200000": ("1043 /dev/nvidia3", "/dev/full"),
              "7f0000200000-7f0000400000": ("1041 /dev/nvidiactl", "/dev/zero"),
              "7f0000400000-7f0000600000": ("1050 /dev/nvidia-uvm (deleted)", "/dev/null"),
              "7f0000600000-7f0000800000": ("1060 /dev/nvidia5", str(fake)),
              "7f0000800000-7f0000a00000": ("99 /usr/lib/libcuda.so.1", str(fake))}
    lines = []
    for rng, (tail, target) in ranges.items():
        (pid / "map_files" / rng).symlink_to(target)
        lines.append(f"{rng} rw-s 00000000 00:05 {tail}\n")
    (pid / "maps").write_text("".join(lines))
    held = ProcHost(table, proc=str(tmp_path)).holdings([4242])[4242]
    assert held.minors == {3, CONTROL} and held.via == {"maps"}


def test_signal_returns_the_typed_result(sleeper):
    """ProcHost.signal answers with SignalResult members (plain words in JSON and logs)."""
    from pvegpu.core.model import SignalResult

    host = ProcHost(TABLE)
    res = host.signal(host.describe(sleeper.pid).ident, signal.SIGKILL, 129)
    assert res is SignalResult.MOVED and f"{res}" == "moved"


def test_simulated_host_changes_only_the_boundary():
    """The simulated host is ProcHost with a Boundary strategy: it overrides none of ProcHost's methods."""
    from pvegpu.sim.host import SessionHost

    overridden = {n for n in vars(SessionHost) if callable(vars(SessionHost)[n]) and n != "__init__"}
    assert not overridden & set(vars(ProcHost))


def test_shared_readers_are_stdlib_leaves():
    """procstat and safetext (shared by adapters, sim and renderers) import nothing of pvegpu: the standard library only."""
    import ast

    for mod in ("adapters/procstat", "core/safetext"):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pvegpu", f"{mod}.py")
        tree = ast.parse(open(path).read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {"." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.startswith((".", "pvegpu"))}, (mod, names)
        assert {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}, (mod, names)


def test_simulated_host_fills_the_same_fields(sim_node):
    """On the simulated node a workload is placed in its CT by session, and ppid, uid and cmdline are filled as on a node."""
    node = sim_node({"node": "s", "gpus": [{"minor": 0, "index": 0}], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}]}]})
    _pve, _nvml, host = node.ports()
    pids = host.ct_pids(129)
    [init] = [i for p in pids if (i := host.describe(p)).is_ct_init]
    [holder] = [host.describe(p) for p in host.holdings(pids)]
    assert holder.placement.vmid == 129 and not holder.is_ct_init and holder.ppid == init.pid
    assert holder.uid == os.getuid() and "pvegpu.sim" in holder.cmdline


@pytest.mark.root
@root
def test_user_bound_lxc_command_socket_does_not_make_a_container_running():
    """A local user (unprivileged uid) binds @/var/lib/lxc/<vmid>/command, PVE's own 'running' test: the audit still
    calls that CT stopped; a CT with a populated lxc/<vmid> cgroup (only root makes one) is running."""
    from pvegpu.adapters.nodefiles import LocalNodeFiles

    fake, real = pvelike.claim_vmids(2)
    code = (f"import os, socket, time; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
            f"s = socket.socket(socket.AF_UNIX); s.bind('\\0/var/lib/lxc/{fake}/command'); s.listen(); "
            f"print(os.getuid(), flush=True); time.sleep(60)")
    user = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    ct = pvelike.start_ct(real, ["sleep", "60"])
    try:
        assert user.stdout is not None and user.stdout.readline().strip() == "65534"
        deadline = time.monotonic() + 10
        while not pvelike.ct_procs(real) and time.monotonic() < deadline:
            time.sleep(0.02)
        running = LocalNodeFiles().running_cts()
        assert running is not None and real in running and fake not in running
    finally:
        user.kill()
        user.wait()
        pvelike.destroy_ct(real)
        ct.wait(5)
        for v in (fake, real):
            pvelike.release_vmid(v)


_MAPPED_ONLY = r"""
import ctypes, os, time
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open('/dev/zero', os.O_RDONLY)
assert libc.mmap(None, 4096, 1, 2, fd, 0) not in (None, 2**64 - 1)  # PROT_READ, MAP_PRIVATE
os.close(fd)  # mapped only (Python's mmap would keep a dup of the fd)
print('ok', flush=True)
time.sleep(60)
"""


def _no_map_files(monkeypatch):
    """Make ``stat`` of ``/proc/<pid>/map_files/*`` fail as it does for a non-root user (EPERM), even as root."""
    real = os.stat

    def stat(path, *a, **kw):
        if "/map_files/" in os.fspath(path):
            raise PermissionError(1, "Operation not permitted", path)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)

    def stat_of(path):
        st = stat(path)
        return st.st_mode, st.st_rdev

    return stat_of  # for a ProcHost: the real scan stats map_files without os.stat (statx, AT_STATX_DONT_SYNC)


def test_simulated_host_finds_a_mapped_stand_in_without_map_files(tmp_path, monkeypatch):
    """Where map_files cannot be stat'ed (a user), the simulated host still finds a mapped-only stand-in by the
    maps line's device and inode and reads the process's other mappings as no GPU; the real adapter calls it unreadable."""
    from pvegpu.sim.host import SessionHost
    from pvegpu.sim.state import SimState

    state = SimState(str(tmp_path))
    state.set_gpus([{"minor": 0, "index": 0, "stand_in": "/dev/zero"}])
    zero = os.stat("/dev/zero").st_rdev
    p = subprocess.Popen([sys.executable, "-c", _MAPPED_ONLY], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ok"
        stat_of = _no_map_files(monkeypatch)
        held = SessionHost(state).holdings([p.pid])[p.pid]
        assert held.minors == {0} and held.via == {"maps"}
        real = ProcHost(DeviceTable({(os.major(zero), os.minor(zero)): 0}), stat_of=stat_of).holdings([p.pid])[p.pid]
        assert "unreadable" in real.via and not real.minors
    finally:
        p.kill()
        p.wait()


def test_simulated_host_matches_mappings_by_inode_not_path(tmp_path):
    """The simulated host's maps rule: a line counts only if its device and inode are a stand-in's file;
    a line whose path reads like the stand-in (other inode) holds nothing, and no map_files is read."""
    from pvegpu.adapters.devscan import ScanBudget
    from pvegpu.sim.host import StandInScan, StandInTable

    st = os.stat("/dev/full")
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    pid = tmp_path / "4242"
    (pid / "fd").mkdir(parents=True)  # no map_files directory at all
    (pid / "maps").write_text(f"7f0000000000-7f0000001000 r--p 00000000 {dev} {st.st_ino + 1}   /dev/full\n"
                              f"7f0000001000-7f0000002000 r--p 00000000 fd:01 1234   /usr/lib/libc.so.6\n")
    scan = StandInScan(StandInTable([{"minor": 3, "stand_in": "/dev/full"}]), ScanBudget(), cache={})
    assert scan.run(str(tmp_path), 4242) is None
    (pid / "maps").write_text(f"7f0000000000-7f0000001000 r--p 00000000 {dev} {st.st_ino}   /tmp/innocent\n")
    held = scan.run(str(tmp_path), 4242)
    assert held is not None and held.minors == {3} and held.via == {"maps"}


def test_simulated_reset_is_clean_without_a_restart_where_map_files_is_unreadable(sim_node, monkeypatch):
    """As a user (map_files unreadable), a simulated reset of the demo's kind of CT ends clean by signals alone:
    the CT's init and its mapped stand-ins are not 'unknown' holders, so no restart is needed (the demo's 0.3 s)."""
    from pvegpu.adapters.clock import SystemClock
    from pvegpu.reset import Ports, ResetOutcome, ResetPolicy, reset

    node = sim_node({"node": "s", "gpus": [{"minor": 0, "index": 0, "mappable": True}], "containers": [
        {"vmid": 129, "gpus": [0], "workloads": [{"kind": "simple", "gpu": 0, "mib": 64}, {"kind": "fork", "gpu": 0, "mib": 32}]}]})
    _no_map_files(monkeypatch)
    pve, nvml, host = node.ports()
    rep = reset(129, Ports(pve, nvml, host, SystemClock()), ResetPolicy(grace=1, timeout=5, task_timeout=5))
    assert rep.outcome is ResetOutcome.CLEAN and not rep.restarted


@pytest.mark.root(reason="needs root: as a user another user's process reads as unreadable, so a holder of anything")
def test_private_stand_ins_are_distinct_devices_nobody_else_holds():
    """Two private stand-ins (as the LXC lab and these tests make) have distinct device numbers, neither
    /dev/full's, and a process holding /dev/full holds neither; one holding the stand-in is found."""
    from tests import lxc_lab

    a, b = lxc_lab.StandIn(), lxc_lab.StandIn()
    try:
        assert len({a.rdev, b.rdev, FULL}) == 3
        full, mine = _holder("/dev/full"), _holder(a.path)
        try:
            assert ProcHost(a.table).holdings([full.pid, mine.pid]).keys() == {mine.pid}
            assert ProcHost(b.table).holdings([full.pid, mine.pid]) == {}
        finally:
            for q in (full, mine):
                q.kill()
                q.wait()
    finally:
        a.close()
        b.close()


def test_cgroup_frozen_reads_cgroup_events(tmp_path):
    """The adapter's frozen flag comes from cgroup.events of the process's v2 cgroup (v2 root or hybrid unified)."""
    for sub in ("", "unified"):
        d = tmp_path / sub / "lxc" / "7" / "ns"
        d.mkdir(parents=True)
        (d / "cgroup.events").write_text("populated 1\nfrozen 1\n")
        assert cgroup_frozen(b"4:memory:/\n0::/lxc/7/ns\n", str(tmp_path))
        (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")
        assert not cgroup_frozen(b"0::/lxc/7/ns\n", str(tmp_path))
        (d / "cgroup.events").unlink()
    assert not cgroup_frozen(b"0::/lxc/7/../../x\n", str(tmp_path)) and not cgroup_frozen(None, str(tmp_path))
