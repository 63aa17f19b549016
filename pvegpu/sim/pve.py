"""Simulated Proxmox API power actions for a simulated node (reads go through the real /etc/pve reader).

``stop`` is ``lxc-stop --kill``: SIGKILL to every process of the container. ``start`` runs the
container's hookscript ``pre-start`` exactly as PVE does (argv ``<script> <vmid> pre-start``,
``PATH=/sbin:/bin:/usr/sbin:/usr/bin``, ``LC_ALL=C``, stdin ``/dev/null``) and fails the task with PVE's
wording when it refuses, then starts a new init. Tasks finish synchronously with real UPIDs.
Knobs in the container's state: ``lock``, ``ha_managed``, ``ha_state``, ``start_error``, ``stop_error``,
``init_dies`` (the start task ends OK, then the container's init exits at once: a broken init or service),
``start_no_answer`` (a start request gets no answer, an API timeout: the start may still happen, and here does not).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from pvegpu.adapters.clock import SystemClock
from pvegpu.adapters.etcpve import EtcPve
from pvegpu.adapters.tasks import wait_task
from pvegpu.core.errors import PveApiError, PveNoAnswer
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import CtStatus, Guest, TaskResult
from pvegpu.sim.sessions import kill_session
from pvegpu.sim.state import SimState, read_json
from pvegpu.sim.workload import start_ticks

PVE_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"


class SimPve(EtcPve):
    def __init__(self, state: SimState, node: str) -> None:
        super().__init__(state.etc_pve, node=node)
        self.state = state

    def ct_status(self, guest: Guest) -> CtStatus:
        ct = self.state.ct(guest.vmid)
        return CtStatus(str(ct.get("status", "stopped")), bool(ct.get("ha_managed")), ct.get("lock") or None,
                        (str(ct.get("ha_state") or "started") if ct.get("status") == "running" else str(ct.get("ha_state") or "stopped"))
                        if ct.get("ha_managed") else None)

    def _task(self, guest: Guest, kind: str, error: str | None, log: list[str]) -> str:
        n = len(os.listdir(os.path.join(self.state.root, "tasks"))) if os.path.isdir(os.path.join(self.state.root, "tasks")) else 0
        now = int(time.time())
        upid = f"UPID:{guest.node}:{os.getpid():08X}:{start_ticks():08X}:{now + n:08X}:{kind}:{guest.vmid}:root@pam:"
        status = error or "OK"
        log = log + ([f"TASK ERROR: {error}"] if error else ["TASK OK"])
        self.state.write_json(f"tasks/{n:06d}.json", {"upid": upid, "status": "stopped", "exitstatus": status, "log": log})
        return upid

    def _find(self, upid: str) -> dict[str, Any]:
        d = os.path.join(self.state.root, "tasks")
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            t = read_json(os.path.join(d, name), {})
            if t.get("upid") == upid:
                return dict(t)
        raise PveApiError(f"read task status: 500 no such task '{upid}'", None)

    def task_status(self, node: str, upid: str) -> dict[str, Any]:
        t = self._find(upid)
        return {"upid": upid, "node": node, "status": t["status"], "exitstatus": t["exitstatus"]}

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        return list(self._find(upid)["log"])[-limit:]

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str, progress: Any = None) -> TaskResult:
        """Tasks of the simulated node end at once; the shared loop still reads their status and log."""
        return wait_task(lambda: self.task_status(node, upid), lambda: self.task_log(node, upid), SystemClock(),
                         node=node, upid=upid, timeout=timeout, what=what, progress=progress)

    def _check(self, guest: Guest, ct: dict[str, Any]) -> None:
        if ct.get("lock"):
            raise PveApiError(f"500 CT is locked ({ct['lock']})", f"`pct unlock {guest.vmid}`")

    def ct_stop(self, guest: Guest) -> str:
        ct = self.state.ct(guest.vmid)
        if ct.get("status") != "running":
            raise PveApiError(f"stop CT {guest.vmid}: 500 CT {guest.vmid} not running", None)
        self._check(guest, ct)
        if ct.get("stop_error"):
            return self._task(guest, "vzstop", str(ct["stop_error"]), [])
        kill_session(self.state.root, ct)  # only while its init is provably this node's (sessions.own_init)
        ct.update(status="stopped", init_pid=None, sid=None)
        self.state.set_ct(guest.vmid, ct)
        return self._task(guest, "vzstop", None, [])

    def ct_start(self, guest: Guest) -> str:
        ct = self.state.ct(guest.vmid)
        if ct.get("status") == "running":
            raise PveApiError(f"start CT {guest.vmid}: 500 CT {guest.vmid} already running", None)
        self._check(guest, ct)
        if ct.get("start_no_answer"):
            raise PveNoAnswer(f"start CT {guest.vmid}: no answer from the API (read timeout)", None)
        log: list[str] = []
        hook = parse_config(self.ct_config(guest)).hookscript
        if hook:
            err = self._run_hook(guest.vmid, hook, log)
            if err:
                return self._task(guest, "vzstart", err, log)
        if ct.get("start_error"):
            return self._task(guest, "vzstart", str(ct["start_error"]), log)
        ct["workloads"] = ct.get("on_restart", [])
        self.state.set_ct(guest.vmid, ct)
        start_init(self.state, guest.vmid)
        upid = self._task(guest, "vzstart", None, log)
        if ct.get("init_dies"):  # vzstart said OK; the init exits right after
            ct = self.state.ct(guest.vmid)
            kill_session(self.state.root, ct)
            ct.update(status="stopped", init_pid=None, sid=None)
            self.state.set_ct(guest.vmid, ct)
        return upid

    def _run_hook(self, vmid: int, volid: str, log: list[str]) -> str | None:
        path = os.path.join(self.state.snippets, volid.split("snippets/", 1)[-1])
        if not os.access(path, os.X_OK):
            return f"hookscript error for {vmid} on pre-start: script '{volid}' does not exist or is not executable"
        log.append(f"GUEST HOOK: {vmid} pre-start")
        env = {"PATH": PVE_PATH, "LC_ALL": "C", "PVEGPU_SIMULATE": self.state.root}
        proc = subprocess.run([path, str(vmid), "pre-start"], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=60)
        log.extend(line for line in (proc.stdout + proc.stderr).splitlines() if line)
        if proc.returncode != 0:
            return f"hookscript error for {vmid} on pre-start: command '{path} {vmid} pre-start' failed: exit code {proc.returncode}"
        return None


def start_init(state: SimState, vmid: int, expect_contexts: int = 0, deadline: float = 10.0) -> None:
    """Start the container's init in a new session and wait (bounded) until it and its workloads are up."""
    before = state.ct(vmid).get("init_pid")
    subprocess.Popen([sys.executable, "-m", "pvegpu.sim.init", state.root, str(vmid)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        ct = state.ct(vmid)
        if ct.get("status") == "running" and ct.get("init_pid") not in (None, before):
            n = len([c for c in state.contexts()])
            if n >= expect_contexts:
                return
        time.sleep(0.01)
    raise PveApiError(f"simulated CT {vmid} did not come up within {deadline:g} s", None)
