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

from pvegpu.sim.state import SimState
from pvegpu.sim.workload import hold, run, start_ticks


def _spawn(state: SimState, w: dict[str, object]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            run(state, int(w.get("gpu", 0)), int(w.get("mib", 1024)), str(w.get("kind", "simple")),  # type: ignore[call-overload]
                leak=bool(w.get("leak")))
        finally:
            os._exit(1)
    return pid


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
    children = {_spawn(state, w): w for w in workloads if w.get("kind") != "init"}
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
