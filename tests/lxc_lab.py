"""Real LXC containers (Debian's lxc, busybox template) with Proxmox's cgroup layout, for root tests.

A GPU is stood in for by a private pseudo-terminal of this run (``StandIn``: a high-index pty whose master the
lab keeps open), bind-mounted into each container as /dev/nvidia0 as PVE users pass real GPUs
(``lxc.mount.entry = /dev/pts/N dev/nvidia0 none bind,create=file`` plus the devices cgroup allow for it); the
scanner is told that its device number (136:N) is GPU 0. No other process on the machine holds that number, so
a concurrent run of the suite or a simulated node left running cannot look like a holder of the lab's GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.procfs import DeviceTable
from pvegpu.adapters.tasks import wait_task
from pvegpu.core.model import CtStatus, Guest, TaskResult
from tests.pvelike import claim_vmids, private_device, release_vmid  # noqa: F401 (the lab's id claims)


class StandIn:
    """This run's GPU 0: a pty slave nobody else opens (the master stays open until ``close``), and its table."""

    def __init__(self) -> None:
        self.master, self.path, self.rdev = private_device()  # the slave closed: this process must not hold the GPU
        self.table = DeviceTable({(os.major(self.rdev), os.minor(self.rdev)): 0})

    def close(self) -> None:
        os.close(self.master)


def available() -> str | None:
    """None when real LXC containers can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "needs root to run LXC containers"
    if not shutil.which("lxc-create") or not os.path.exists("/usr/share/lxc/templates/lxc-busybox"):
        return "needs Debian's lxc package and busybox-static (apt-get install lxc busybox-static)"
    return None


def cleanup_cgroups(vmid: int) -> None:
    """Remove stale lxc/<vmid> and lxc.monitor/<vmid> cgroups on every hierarchy, as PVE's prestart hook does
    (lxc refuses to start a container whose monitor cgroup is left over)."""
    base = "/sys/fs/cgroup"
    tops = [os.path.join(base, h, kind, str(vmid)) for h in [""] + sorted(os.listdir(base)) for kind in ("lxc", "lxc.monitor")]
    for top in tops:
        if not os.path.isdir(top):
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass


# the devices controller: cgroup v1's where this host mounts it (a hybrid layout), else cgroup v2's (PVE 7 and later)
DEVICES_KEY = "lxc.cgroup.devices.allow" if os.path.isdir("/sys/fs/cgroup/devices") else "lxc.cgroup2.devices.allow"


def make_ct(vmid: int, gpu: StandIn, inittab_extra: str = "") -> None:
    """lxc-create a busybox CT named <vmid> with PVE's cgroup dirs and the stand-in bind-mounted as dev/nvidia0."""
    subprocess.run(["lxc-stop", "-n", str(vmid), "-k"], capture_output=True, timeout=30)
    subprocess.run(["lxc-destroy", "-n", str(vmid), "-f"], capture_output=True)
    cleanup_cgroups(vmid)
    subprocess.run(["lxc-create", "-n", str(vmid), "-t", "busybox"], check=True, capture_output=True)
    cfg = f"/var/lib/lxc/{vmid}/config"
    lines = [ln for ln in open(cfg).read().splitlines() if not ln.startswith(("lxc.net.0", "lxc.apparmor"))]
    lines += ["lxc.net.0.type = empty", "lxc.apparmor.profile = unconfined",
              f"lxc.cgroup.dir.monitor = lxc.monitor/{vmid}", f"lxc.cgroup.dir.container = lxc/{vmid}",
              "lxc.cgroup.dir.container.inner = ns", f"lxc.mount.entry = {gpu.path} dev/nvidia0 none bind,create=file",
              f"{DEVICES_KEY} = c {os.major(gpu.rdev)}:{os.minor(gpu.rdev)} rwm"]
    with open(cfg, "w") as f:
        f.write("\n".join(lines) + "\n")
    if inittab_extra:
        with open(f"/var/lib/lxc/{vmid}/rootfs/etc/inittab", "a") as f:
            f.write(inittab_extra)


def start(vmid: int) -> None:
    cleanup_cgroups(vmid)
    subprocess.run(["lxc-start", "-n", str(vmid)], check=True, capture_output=True)
    end = time.monotonic() + 10
    while "RUNNING" not in subprocess.run(["lxc-info", "-n", str(vmid), "-s"], capture_output=True, text=True).stdout:
        assert time.monotonic() < end, f"CT {vmid} did not start"
        time.sleep(0.05)


def attach(vmid: int, script: str) -> None:
    subprocess.run(["lxc-attach", "-n", str(vmid), "--", "sh", "-c", script], check=True, capture_output=True, timeout=10)


def running(vmid: int) -> bool:
    return "RUNNING" in subprocess.run(["lxc-info", "-n", str(vmid), "-s"], capture_output=True, text=True).stdout


def destroy(vmid: int) -> None:
    subprocess.run(["lxc-stop", "-n", str(vmid), "-k"], capture_output=True, timeout=30)
    subprocess.run(["lxc-destroy", "-n", str(vmid), "-f"], capture_output=True, timeout=30)
    end = time.monotonic() + 5
    while running(vmid) and time.monotonic() < end:
        time.sleep(0.05)
    cleanup_cgroups(vmid)


class LxcPve:
    """PveApi whose reads come from a PVE-like /etc/pve tree and whose stop/start are lxc-stop --kill / lxc-start,
    which is what PVE's vzstop/vzstart run underneath. With ``guard`` (a hookscript path), a start first runs it as
    PVE does (``<guard> <vmid> pre-start``, PVE's environment plus ``guard_env``) and fails with PVE's wording when
    it refuses."""

    def __init__(self, etc: object, guard: str | None = None, guard_env: dict[str, str] | None = None) -> None:
        self.etc = etc
        self.guard, self.guard_env = guard, dict(guard_env or {})
        self.hook_log: list[str] = []
        self.calls: list[str] = []
        self.tasks: dict[str, str] = {}

    def __getattr__(self, name: str):
        return getattr(self.etc, name)

    def ct_status(self, g: Guest) -> CtStatus:
        return CtStatus("running" if running(g.vmid) else "stopped")

    def _task(self, kind: str, g: Guest, proc: subprocess.CompletedProcess) -> str:
        upid = f"UPID:lab:{len(self.tasks):08X}:00000000:00000000:{kind}:{g.vmid}:root@pam:"
        self.tasks[upid] = "OK" if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")
        return upid

    def ct_stop(self, g: Guest) -> str:
        self.calls.append(f"stop {g.vmid}")
        return self._task("vzstop", g, subprocess.run(["lxc-stop", "-n", str(g.vmid), "-k"], capture_output=True, text=True, timeout=60))

    def ct_start(self, g: Guest) -> str:
        self.calls.append(f"start {g.vmid}")
        if self.guard:
            from tests.pvelike import run_as_pve

            r = run_as_pve(self.guard, g.vmid, "pre-start", self.guard_env)
            self.hook_log += [f"GUEST HOOK: {g.vmid} pre-start", *(r.stdout + r.stderr).splitlines()]
            if r.returncode != 0:
                err = f"hookscript error for {g.vmid} on pre-start: command '{self.guard} {g.vmid} pre-start' failed: exit code {r.returncode}"
                return self._task("vzstart", g, subprocess.CompletedProcess([], 1, "", err))
        cleanup_cgroups(g.vmid)  # what PVE's prestart hook does
        return self._task("vzstart", g, subprocess.run(["lxc-start", "-n", str(g.vmid)], capture_output=True, text=True, timeout=60))

    def task_status(self, node: str, upid: str) -> dict:
        return {"status": "stopped", "exitstatus": self.tasks[upid]}

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        return [self.tasks[upid]]

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str, progress: Any = None) -> TaskResult:
        return wait_task(lambda: self.task_status(node, upid), lambda: self.task_log(node, upid), SystemClock(),
                         node=node, upid=upid, timeout=timeout, what=what, progress=progress)
