"""An in-process fake of the VM API (``FakeVm``: a running VM 200 whose guest holds a GPU, with knobs for faults) and
a clock whose sleep moves time on, for the VM reset's tests on a fake clock."""

from __future__ import annotations

from pvegpu.core.model import Guest, TaskResult
from pvegpu.vm.guest import KILL_SCRIPT, NVSMI_APPS, NVSMI_GPUS, SCAN_SCRIPT

POWER = {"shutdown", "stop", "start"}


class Clock:
    """A fake clock: ``sleep`` moves ``t`` on at once (by at least 1 ms, so every wait makes progress)."""

    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t

    def sleep(self, s):
        self.t += max(s, 0.001)


class FakeVm:
    """A running VM 200 whose guest shows pid 4242 holding the GPU (fd+maps); knobs for faults."""

    def __init__(self, clock, *, status=None, exec_error=None, holder_line="holder 4242 777 fd,maps python3", exec_cost=0.0,
                 kill_ignored=False):
        self.clock, self.calls = clock, []
        self.status = status or {"status": "running"}
        self.exec_error, self.holder_line, self.exec_cost, self.kill_ignored = exec_error, holder_line, exec_cost, kill_ignored
        self.execs, self.n, self.alive = {}, 0, True
        self.guest = Guest(200, "pve1", "qemu")

    def where(self, vmid):
        return self.guest

    def vm_config(self, g):
        return {"hostpci0": "0000:41:00.0,pcie=1", "agent": "1", "ostype": "l26"}

    def vm_status(self, g):
        return dict(self.status)

    def agent_ping(self, g):
        self.calls.append("ping")

    def agent_exec(self, g, argv):
        self.calls.append(("exec", argv[0] if argv[0] != "sh" else argv[3]))
        if self.exec_error:
            raise self.exec_error
        self.n += 1
        self.execs[self.n] = list(argv)
        return self.n

    def agent_exec_status(self, g, pid):
        self.clock.t += self.exec_cost
        argv = self.execs[pid]
        if tuple(argv) == NVSMI_APPS:
            return {"exited": 1, "exitcode": 0, "out-data": "4242, 1024\n" if self.alive else ""}
        if tuple(argv) == NVSMI_GPUS:
            return {"exited": 1, "exitcode": 0, "out-data": "0, 00000000:01:00.0, 1024\n"}
        if argv[:3] == ["sh", "-c", SCAN_SCRIPT]:
            return {"exited": 1, "exitcode": 0, "out-data": (self.holder_line + "\n" if self.alive else "") + "scan-done\n"}
        if argv[:3] == ["sh", "-c", KILL_SCRIPT]:
            if not self.kill_ignored:
                self.alive = False
            return {"exited": 1, "exitcode": 0, "out-data": "sent 4242\nkill-done\n"}
        raise AssertionError(argv)

    def _power(self, what, state):
        self.calls.append(what)
        self.status["status"] = state
        return f"UPID:{what}"

    def vm_shutdown(self, g, timeout):
        return self._power("shutdown", "stopped")

    def vm_stop(self, g):
        return self._power("stop", "stopped")

    def vm_start(self, g):
        return self._power("start", "running")

    def wait_task(self, node, upid, *, timeout, what):
        return TaskResult(upid, "OK")


def power_calls(vm: FakeVm) -> set[str]:
    """The power actions (shutdown, stop, start) the VM was asked for."""
    return POWER & {c for c in vm.calls if isinstance(c, str)}
