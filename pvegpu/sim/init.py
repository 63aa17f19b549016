"""PID 1 of a simulated container: starts its workloads, reaps children, respawns ``respawn`` ones; with an
``init`` workload it is the GPU job itself (an application container's PID 1).

Run as ``python -m pvegpu.sim.init STATE_DIR VMID`` in a new session; the session is the container.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Any

from pvegpu.sim.state import SimState
from pvegpu.sim.workload import hold, rank, run, start_ticks


def _spawn(state: SimState, w: dict[str, Any], i: int = 0) -> int:
    """Fork one process of workload ``w`` (``i``: which rank of a ``tp`` job)."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if w.get("kind") == "tp":
                rank(state, [int(g) for g in w["gpus"]], i, int(w.get("mib", 1024)),
                     fork_child=w.get("fork_child_of_rank") == i, leak=w.get("driver_keeps_rank") == i)
            run(state, int(w.get("gpu", 0)), int(w.get("mib", 1024)), str(w.get("kind", "simple")), leak=bool(w.get("leak")))
        finally:
            os._exit(1)
    return pid


def processes(w: dict[str, Any]) -> int:
    """How many processes the init starts for workload ``w`` (each registers one context): a ``tp`` job's ranks."""
    return len(w.get("gpus") or []) if w.get("kind") == "tp" else 1


def _subreaper() -> None:
    """Orphans of the container re-parent to its init, as they do to PID 1 of a container's PID namespace."""
    try:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    _subreaper()
    state, vmid = SimState(argv[0]), int(argv[1])
    ct = state.ct(vmid)
    workloads = list(ct.get("workloads", []))
    children = {_spawn(state, w, i): w for w in workloads if w.get("kind") != "init" for i in range(processes(w))}
    for w in workloads:  # an application container: PID 1 is the GPU job itself (its server), after the forks above
        if w.get("kind") == "init":
            hold(state, int(w.get("gpu", 0)), int(w.get("mib", 1024)), leak=bool(w.get("leak")))
    me = os.getpid()
    ct.update(status="running", init_pid=me, init_start=start_ticks(), sid=os.getsid(0))
    state.set_ct(vmid, ct)
    while True:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            time.sleep(3600)
            continue
        w = children.pop(pid, None)
        if w and w.get("kind") == "respawn":
            children[_spawn(state, w)] = w


if __name__ == "__main__":
    main(sys.argv[1:])
