"""Stand-ins for GPU jobs inside a simulated container (real processes).

Each opens its GPU's stand-in device node (that open fd is what the fd scan finds, by device number,
exactly as with /dev/nvidiaN) and registers a "CUDA context" with the simulated driver.

Kinds: ``simple`` (one process), ``fork`` (forks a child after GPU init; the child inherits the fds and
is never listed by NVML), ``orphan`` (like fork, then the parent exits: only the unlisted child holds the
memory, in the process group the parent led), ``ignore-term`` (ignores SIGTERM), ``respawn`` (``simple``,
restarted by the container's init whenever it dies, like a systemd unit with Restart=always), ``init`` (the
container's init itself is the GPU job: an application container's PID 1, ``hold`` in ``pvegpu.sim.init``).

``tp`` is a tensor-parallel job (``rank``, one process per rank, started by ``pvegpu.sim.init``): rank ``i``
allocates on the ``i``-th of the job's GPUs only (its one context and memory there, the only GPU NVML lists it on),
but, as every rank of a TP job with all GPUs visible does, it holds an open fd on every one of the job's device
nodes (and maps only its own). Variants: a rank with ``fork_child`` forks a child after its GPU init that
inherits its fds and mapping, keeps its context after the rank dies, is never listed and ignores SIGTERM (as a
helper started under ``nohup`` does), so it outlives the ranks; a rank with ``leak`` leaves its memory to the
driver once every holder is gone (only a GPU reset gives it back).
"""

from __future__ import annotations

import ctypes
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


def _open_gpu(state: SimState, gpu: int, *, mapped: bool = True) -> None:
    """"cuInit" on one GPU: open its stand-in (the fd the scan finds, inherited by forks); ``mapped``: also map it
    when it can be mapped, as CUDA maps the device it has a context on."""
    stand_in = next(g["stand_in"] for g in state.gpus() if int(g["minor"]) == gpu)
    fd = os.open(stand_in, os.O_RDONLY)
    os.set_inheritable(fd, True)
    if not mapped:
        return
    try:  # a stand-in that can be mapped (/dev/zero, a "mappable" one) is mapped too, and forks inherit it
        _mapped.append(mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
    except (OSError, ValueError):
        pass  # an empty file (the default stand-in) or /dev/full cannot be mapped: those holders show as fd-only


def _name(comm: str) -> None:
    """The process's name (``comm``, 15 bytes), as a job names its workers: the reports tell the ranks apart."""
    try:
        ctypes.CDLL(None).prctl(15, comm.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _wait_registered(state: SimState, child: int) -> None:
    """Bounded: until the fork child has registered itself as a holder of its parent's context."""
    deadline = time.monotonic() + 5
    while not os.path.exists(os.path.join(state.root, "holders", f"{child}.json")) and time.monotonic() < deadline:
        time.sleep(0.002)


def rank(state: SimState, gpus: list[int], i: int, mib: int, *, fork_child: bool = False, leak: bool = False) -> None:
    """Become rank ``i`` of a tensor-parallel job over ``gpus``; never returns (see the module's ``tp``)."""
    _name(f"tp-rank{i}")
    for g in gpus:  # every rank opens every visible GPU; it maps, and allocates on, its own only
        _open_gpu(state, g, mapped=g == gpus[i])
    me = os.getpid()
    if fork_child:
        child = os.fork()
        if child == 0:
            _name(f"tp-rank{i}-child")
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            state.add_holder(os.getpid(), start_ticks(), me)
            _forever()
        _wait_registered(state, child)
    # the context is registered last: a container counts as up once its contexts are, its holders are there by then
    state.add_context(me, start_ticks(), gpus[i], mib * MIB, leaks=leak)
    _forever()


def hold(state: SimState, gpu: int, mib: int, *, leak: bool = False) -> None:
    """"cuInit" and one allocation of ``mib`` MiB on ``gpu`` by this process. ``leak``: the driver keeps the
    context's memory when it is released (a driver-level leak of this container's memory, no pid listed for it)."""
    _open_gpu(state, gpu)
    state.add_context(os.getpid(), start_ticks(), gpu, mib * MIB, leaks=leak)


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
        _wait_registered(state, child)
        if kind == "orphan":
            os._exit(0)
    _forever()
