"""Stand-ins for GPU jobs inside a simulated container (real processes).

Each opens its GPU's stand-in device node (that open fd is what the fd scan finds, by device number,
exactly as with /dev/nvidiaN) and registers a "CUDA context" with the simulated driver.

Kinds: ``simple`` (one process), ``fork`` (forks a child after GPU init; the child inherits the fds and
is never listed by NVML), ``orphan`` (like fork, then the parent exits: only the unlisted child holds the
memory, in the process group the parent led), ``ignore-term`` (ignores SIGTERM), ``respawn`` (``simple``,
restarted by the container's init whenever it dies, like a systemd unit with Restart=always), ``init`` (the
container's init itself is the GPU job: an application container's PID 1, ``hold`` in ``pvegpu.sim.init``).
"""

from __future__ import annotations

import mmap
import os
import signal
import time

from pvegpu.adapters.procstat import read_stat
from pvegpu.core.model import MIB
from pvegpu.sim.state import SimState


def start_ticks(pid: int | str = "self") -> int:
    """Stat field 22 of a running process (``/proc/<pid>/stat``); raises OSError when it is gone."""
    st = read_stat(pid)
    if st is None:
        raise ProcessLookupError(f"no process {pid}")
    return st.start_ticks


def _forever() -> None:
    while True:
        signal.pause()


_mapped: list[mmap.mmap] = []


def hold(state: SimState, gpu: int, mib: int, *, leak: bool = False) -> int:
    """"cuInit" and one allocation of ``mib`` MiB on ``gpu`` by this process; returns the device fd. ``leak``: the
    driver keeps the context's memory when it is released (a driver-level leak, no pid listed for it)."""
    stand_in = next(g["stand_in"] for g in state.gpus() if int(g["minor"]) == gpu)
    fd = os.open(stand_in, os.O_RDONLY)  # "cuInit": the device fd the scan finds
    os.set_inheritable(fd, True)
    try:  # CUDA also maps the device; a stand-in that can be mapped (/dev/zero) is mapped too, and forks inherit it
        _mapped.append(mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
    except (OSError, ValueError):
        pass  # an empty file (the default stand-in) or /dev/full cannot be mapped: those holders show as fd-only
    state.add_context(os.getpid(), start_ticks(), gpu, mib * MIB, leaks=leak)
    return fd


def run(state: SimState, gpu: int, mib: int, kind: str, *, leak: bool = False) -> None:
    """Become a GPU holder of ``kind``; never returns (``hold``: ``leak``)."""
    if kind == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hold(state, gpu, mib, leak=leak)
    me = os.getpid()
    if kind == "orphan":  # a shell job leads its process group: the child keeps the group's id, the link to this pid
        os.setpgid(0, 0)
    if kind in ("fork", "orphan"):
        child = os.fork()
        if child == 0:
            state.add_holder(os.getpid(), start_ticks(), me)
            _forever()
        deadline = time.monotonic() + 5
        while not os.path.exists(os.path.join(state.root, "holders", f"{child}.json")) and time.monotonic() < deadline:
            time.sleep(0.002)
        if kind == "orphan":
            os._exit(0)
    _forever()
