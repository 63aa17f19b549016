"""PVE-like containers as the host sees them, for the side-by-side benchmark (root; no GPU needed).

A container is: a monitor process in cgroup ``/lxc.monitor/<vmid>``, and an init that reaps (PID 1 of its
own PID and mount namespace, cgroup ``/lxc/<vmid>/ns``) running the payload as its child. The mount
namespace is a copy of the host's, so ``/dev/nvidia*`` are visible inside, as PVE's passthrough makes
them. Manual equivalents: ``pct start VMID`` / ``pct stop VMID`` (here: cgroup.kill), ``pct exec VMID``
(here: ``nsenter -t <init> -m -p``), ``cat /sys/fs/cgroup/lxc/VMID/ns/cgroup.procs``.
An application container (PVE 9.1 OCI image, ``entrypoint``/``lxc.init.cmd`` in its config) has no reaping init:
its entrypoint is PID 1 itself (``start_ct(..., entry=ARGV)``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from tests.pvelike import cgroup_procs

# PID 1 of the container: move into the payload cgroup, call itself "init", run the payload, reap every
# child (orphans too) forever. SIGTERM from inside is ignored by the kernel for a namespace init.
INIT = r"""
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, b"init", 0, 0, 0)  # named before it is visible in the cgroup
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
if sys.argv[2]:
    if os.fork() == 0:
        os.execv("/bin/sh", ["sh", "-c", sys.argv[2]])
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""

# PID 1 of an application container: move into the payload cgroup, then become the entrypoint (exec), as LXC runs
# ``lxc.init.cmd``: the workload is the namespace's init, and nothing else runs in the container.
APP_INIT = r"""
import os, sys
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
os.execvp(sys.argv[2], sys.argv[2:])
"""


def cgroup_root() -> str:
    return "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"


def ct_cgroup(vmid: int) -> str:
    return os.path.join(cgroup_root(), "lxc", str(vmid))


def ns_cgroup(vmid: int) -> str:
    return os.path.join(ct_cgroup(vmid), "ns")


def monitor_cgroup(vmid: int) -> str:
    return os.path.join(cgroup_root(), "lxc.monitor", str(vmid))


def start_ct(vmid: int, script: str = "", python: str = sys.executable, subcgroups: tuple[str, ...] = (), timeout: float = 10,
             entry: Sequence[str] = (), output: str | None = None) -> int:
    """Start container vmid running ``sh -c script`` under a reaping init, or with ``entry`` (an application
    container's entrypoint argv) as PID 1 itself; returns the init's host PID. ``output``: a file that gets the
    container's stdout and stderr (else they are discarded)."""
    for d in (ns_cgroup(vmid), monitor_cgroup(vmid), *(os.path.join(ns_cgroup(vmid), s) for s in subcgroups)):
        os.makedirs(d, exist_ok=True)
    mon = os.path.join(monitor_cgroup(vmid), "cgroup.procs")

    def enter_monitor() -> None:
        with open(mon, "w") as f:
            f.write(str(os.getpid()))

    code, args = (APP_INIT, list(entry)) if entry else (INIT, [script])
    with open(output, "ab") if output else open(os.devnull, "wb") as out:
        subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", python, "-I", "-S", "-c", code, ns_cgroup(vmid), *args],
                         preexec_fn=enter_monitor, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    end = time.monotonic() + timeout
    while True:
        init = find_init(vmid)
        if init:
            return init
        if time.monotonic() > end:
            raise RuntimeError(f"CT {vmid}: no init in {ns_cgroup(vmid)} after {timeout:g} s")
        time.sleep(0.01)


def _procs(top: str) -> list[int]:
    return cgroup_procs(top)


def ct_pids(vmid: int) -> list[int]:
    """Host PIDs of every process in the container's cgroups (payload, not the monitor)."""
    return _procs(ct_cgroup(vmid))


def ns_pid(pid: int) -> int | None:
    """The PID inside the innermost namespace (``NSpid:`` last field)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def find_init(vmid: int) -> int | None:
    """The container's init: the process of its cgroup that is PID 1 inside."""
    return next((p for p in _procs(ns_cgroup(vmid)) if ns_pid(p) == 1), None)


def kill_ct(vmid: int, timeout: float = 10) -> bool:
    """Stop the container the hard way (what ``pct stop`` ends in): SIGKILL every process of its cgroups
    and the monitor's, wait until they are empty, remove them. False: something survived the deadline."""
    tops = [ct_cgroup(vmid), monitor_cgroup(vmid)]
    end = time.monotonic() + timeout
    for top in tops:
        try:
            with open(os.path.join(top, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
    while True:
        left = [p for t in tops for p in _procs(t)]
        if not left:
            break
        if time.monotonic() > end:
            return False
        for p in left:  # no cgroup.kill (older kernels): signal one by one
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    for top in tops:
        for dirpath, _d, _f in sorted(os.walk(top), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    return True


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks): with the PID, a process's identity."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def cgroup_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def owner(pid: int, target: int) -> str:
    """target, CT <vmid>, host, or gone."""
    cg = cgroup_of(pid)
    if cg is None:
        return "gone"
    parts = cg.strip("/").split("/")
    if len(parts) >= 2 and parts[0] == "lxc" and parts[1].isdigit():
        return "target" if int(parts[1]) == target else f"CT {parts[1]}"
    return "host"


def device_holders(pids: list[int], devs: set[tuple[int, int]]) -> list[int]:
    """The PIDs among pids with an open fd on one of the character devices (major, minor)."""
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_mode & 0o170000) == 0o020000 and (os.major(st.st_rdev), os.minor(st.st_rdev)) in devs:
                out.append(pid)
                break
    return sorted(out)


def identities(pids: list[int], target: int) -> dict[int, tuple[int, str, str]]:
    """pid → (start time, comm, owner) for the collateral check."""
    out = {}
    for p in pids:
        st = start_time(p)
        if st is not None:
            out[p] = (st, comm(p), owner(p, target))
    return out
