"""``nvidia-smi`` for ``pvegpu gpu-reset``: persistence mode and the reset itself, each run under a hard deadline.

The binary is a setting (``gpureset.smi``): a simulated node and the tests point it at a stand-in. pvegpu never runs
it otherwise than from ``pvegpu gpu-reset`` after the plan was shown and confirmed. Each call is a bounded child in
its own process group (``pvesh.run_process_group``, the one such runner): at the deadline the group is killed, and a
child that does not end soon after the SIGKILL (nvidia-smi stuck in the driver, D state) is abandoned, not waited
for, and said. Its own process group also keeps a Ctrl-C at the terminal from killing a reset mid-way: gpu-reset
handles the signal itself and finishes first.

Fabric Manager: a process named ``nv-fabricmanager`` (its ``/proc/<pid>/comm``), or ``systemctl is-active
nvidia-fabricmanager`` saying it runs (bounded too). Manual equivalent: ``pgrep nv-fabricmanage; systemctl
is-active nvidia-fabricmanager``.
"""

from __future__ import annotations

import os

from pvegpu.adapters.pvesh import run_process_group
from pvegpu.core.errors import GpuQueryError
from pvegpu.core.model import GpuInfo
from pvegpu.core.safetext import escape

FABRIC_COMMS = ("nv-fabricmanage",)  # /proc/<pid>/comm is cut at 15 characters: nv-fabricmanager
FABRIC_UNIT = "nvidia-fabricmanager"
SYSTEMCTL_TIMEOUT = 5.0  # seconds `systemctl is-active` may take (systemd answers at once unless it is wedged)
RUNNING = ("active", "activating", "reloading", "deactivating", "refreshing")  # its process may be there: it counts
STOPPED = ("inactive", "failed", "dead")  # a unit that does not exist is "inactive" too: no Fabric Manager


class SmiControl:
    """The ``GpuControl`` port over ``nvidia-smi`` at ``path``; each call bounded by ``timeout`` seconds."""

    def __init__(self, path: str, timeout: float, env: dict[str, str] | None = None, systemctl: str = "systemctl") -> None:
        self.path, self.timeout, self.env, self.systemctl = path, timeout, env, systemctl

    def _run(self, args: list[str], what: str) -> None:
        argv = [self.path, *args]
        shown = escape(" ".join(argv))
        try:
            done = run_process_group(argv, self.timeout, env=self.env)
        except OSError as exc:
            raise GpuQueryError(f"cannot run {self.path}: {exc.strerror or exc}", "set gpureset.smi to nvidia-smi's path") from None
        if done.stuck:
            raise GpuQueryError(f"`{shown}` did not finish within {self.timeout:g} s and did not end after SIGKILL: stuck in "
                                "the driver", f"{what}: `dmesg | grep -i xid` says why; the GPU needs a reboot of the node")
        if done.timed_out:
            raise GpuQueryError(f"`{shown}` did not finish within {self.timeout:g} s (killed)", f"{what}: check `dmesg` for Xid "
                                "lines; the GPU may need a reboot")
        if done.returncode != 0:
            text = (done.stdout + done.stderr).decode("utf-8", "replace")
            said = " | ".join(line.strip() for line in text.splitlines() if line.strip())[:400]
            raise GpuQueryError(f"`{shown}` failed (exit {done.returncode}): {escape(said) or 'no output'}", what)

    def persistence(self, gpu: GpuInfo, on: bool) -> None:
        self._run(["-i", gpu.uuid, "-pm", "1" if on else "0"], "persistence mode")

    def reset(self, gpu: GpuInfo) -> None:
        self._run(["-r", "-i", gpu.uuid], "the GPU reset")

    def fabric_manager(self) -> bool | None:
        """Does NVIDIA Fabric Manager run here? True: its process is there or systemd says its unit runs; False: no
        such process and the unit is inactive, failed or absent (or there is no systemctl); None: cannot tell (/proc
        unreadable, systemctl wedged or saying something else)."""
        seen = self._fabric_process()
        if seen:
            return True
        unit = self._fabric_unit()
        if unit:
            return True
        if unit is None or seen is None:
            return None
        return False

    def _fabric_process(self) -> bool | None:
        """A process named nv-fabricmanager run by the host's root in the host's PID namespace; None when /proc cannot
        be read. A name is anyone's to choose: one of a container (its own PID namespace) or of a host user (not uid 0)
        would otherwise make every gpu-reset of the node refuse."""
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
            host_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            return None
        for pid in pids:
            try:
                with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
                    if f.read().strip() not in FABRIC_COMMS:
                        continue
                if os.stat(f"/proc/{pid}").st_uid == 0 and os.readlink(f"/proc/{pid}/ns/pid") == host_ns:
                    return True
            except OSError:
                continue
        return False

    def _fabric_unit(self) -> bool | None:
        """``systemctl is-active nvidia-fabricmanager``: True running, False not (no such unit, or no systemctl at all:
        no systemd to run it), None when systemctl cannot say (wedged, killed, an answer not known)."""
        try:
            done = run_process_group([self.systemctl, "is-active", FABRIC_UNIT], SYSTEMCTL_TIMEOUT, env=self.env)
        except FileNotFoundError:
            return False
        except OSError:
            return None
        if done.timed_out:
            return None
        state = done.stdout.decode("utf-8", "replace").strip().splitlines()
        word = state[0].strip() if state else ""
        return True if word in RUNNING else False if word in STOPPED else None
