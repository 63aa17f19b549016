"""Which processes are a simulated container's own: the one proof every signal and kill of the simulated node uses.

A simulated container is the session its init started (``python -m pvegpu.sim.init DIR VMID``, run with
``start_new_session``). The init records its identity in the container's state when it starts: pid and start
time (``/proc/<pid>/stat`` field 22). A state file is only a claim (a user can edit their own node's), so the
claim counts only while the process it names is provably that init:

- it is alive with exactly that start time (a recycled pid has another), and leads its own session;
- it runs as the user running pvegpu (a node is used only by its owner: ``trust.check_node``);
- its command line is ``... -m pvegpu.sim.init <this node's directory> <this vmid>``.

A process belongs to the container only when it is in that session *and* descends from that init (its parent
chain reaches it; the init is a child subreaper, so orphans stay below it). Anything else is a host process: the
reset's pidfd re-check then refuses to signal it, and a simulated stop never kills its process group.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pvegpu.adapters.procstat import read_stat

INIT_MODULE = b"pvegpu.sim.init"
DEAD = ("Z", "X")
MAX_DEPTH = 64  # parent links walked from a process up to its container's init (a simulated job is 2-3 deep)


def _pid(value: Any) -> int | None:
    """``value`` when it can name a process other than the host's init, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def own_init(root: str, ct: dict[str, Any]) -> tuple[int, int] | None:
    """(pid, start ticks) of the container's simulated init when ``ct`` (its state) names one that is provably this
    node's (see the module's rules), else None: a stale or edited state never names another process."""
    pid, start, vmid = _pid(ct.get("init_pid")), ct.get("init_start"), ct.get("vmid")
    if pid is None or ct.get("sid") != pid or not isinstance(start, int) or not isinstance(vmid, int):
        return None
    st = read_stat(pid)
    if st is None or st.start_ticks != start or st.sid != pid or st.state in DEAD:
        return None
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(8192).rstrip(b"\0").split(b"\0")
    except OSError:
        return None
    if len(argv) < 3 or argv[-3] != INIT_MODULE or argv[-1] != str(vmid).encode():
        return None
    if os.path.realpath(os.fsdecode(argv[-2])) != os.path.realpath(root):
        return None
    again = read_stat(pid)  # the command line was read from this very process, not from a pid's next owner
    return (pid, start) if again is not None and again.start_ticks == start else None


def descends(pid: int, init: int) -> bool:
    """``pid`` is ``init`` or below it: its parent chain (``/proc/<pid>/stat`` ppid) reaches ``init``."""
    for _ in range(MAX_DEPTH):
        if pid == init:
            return True
        st = read_stat(pid)
        if st is None or st.ppid <= 1:
            return False
        pid = st.ppid
    return False


def members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (``ps -o pid= -s <sid>``, zombies left out)."""
    return [int(n) for n in os.listdir("/proc")
            if n.isdigit() and (st := read_stat(n)) is not None and st.sid == sid and st.state not in DEAD]


def kill_session(root: str, ct: dict[str, Any], deadline: float = 5.0) -> int:
    """``lxc-stop --kill``: SIGKILL every process of the container, only while its init is provably this node's
    (``own_init``), and wait (bounded) until they are gone. Returns how many processes it had (0: none killed).

    Every process group of the session goes, not only the one the init leads: a job that leads its own group (a
    shell job, the ``orphan`` workload) is the container's too, and a real stop ends it with the container. The
    groups are read before the init dies (its orphans are below it only while it lives); a group of the session holds
    only processes forked inside it."""
    init = own_init(root, ct)
    if init is None:
        return 0
    sid = init[0]
    own = [p for p in members(sid) if descends(p, sid)]
    groups = {st.pgid for p in own if (st := read_stat(p)) is not None and st.sid == sid} - {sid}
    try:
        os.killpg(sid, signal.SIGKILL)  # the group the init leads first: only processes forked inside its session can join it
    except (ProcessLookupError, PermissionError):
        return 0
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            os.waitpid(sid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not members(sid):
            break
        time.sleep(0.005)
    return len(own)
