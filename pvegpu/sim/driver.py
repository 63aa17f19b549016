"""One model of the NVIDIA driver, as unkind as the real one, behind every stand-in for NVML.

The simulated node (``sim/nvml.py``), the unit-test fakes (``tests/fakes.py``) and the stand-in NVML of the
real-process tests all read GPU memory through ``DriverModel``, so they all show what the driver shows
(measured on an H200, driver 580.159.04, torch and cupy alike; ``reference/nvidia-gpu.md``):

- **Per-context gap**: NVML's ``used`` includes memory of every live CUDA context that no per-process
  ``usedGpuMemory`` accounts for: ``used - sum(per process)`` = 8.8 MiB with 1 context, 14.4 with 2, 25.6
  with 4, 47.9 with 8, 94.6 with 16, 187.9 with 32, and 0 with none. Modelled as ``gap_base`` (3.0 MiB) once
  any context lives plus ``gap_per_context`` (5.8 MiB) per context.
- **Release latency**: a context's memory returns ``release_latency`` (0.15 s; 0.12-0.2 s measured) after its
  last holder died; until then ``used`` still counts it and its owner's (dead) pid is still listed.
- **One row per process**: NVML lists a process once however many contexts it owns, with their memory summed
  (one process with 16 ``cuCtxCreate`` contexts: one row of 8288 MiB, ``used`` 8383 MiB); the gap counts every
  context.
- **Dead pids listed**: the owner's pid is listed while the context lives, even when only a fork child
  (never listed) keeps it; a ``pinned`` context (an fd parked in flight on a unix socket, a driver leak
  with a pid) lives whatever happens to its holders.
- **Lost GPUs**: ``lost`` at enumeration (``gpus()`` leaves it out and ``failed`` names it: never silently
  dropped), ``fail`` at read (that GPU's sample is an error; the others are read).

Time comes from the ``Clock`` port, so tests drive it with a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pvegpu.core.model import MIB, GpuInfo, GpuSample, NvmlProcess
from pvegpu.core.ports import Clock

GAP_BASE = int(3.0 * MIB)  # measured: 8.8 MiB with one context = 3.0 + 5.8
GAP_PER_CONTEXT = int(5.8 * MIB)  # measured: 187.9 MiB with 32 contexts
RELEASE_LATENCY = 0.15  # seconds from the last holder's death to the memory's return (0.12-0.2 s measured)

Ident = tuple[int, int]  # (pid, start ticks): a process that cannot be confused with a later one


@dataclass
class Context:
    """One CUDA context: the owner NVML lists, the processes whose fds/mappings keep it alive."""

    gpu: int
    nbytes: int
    owner: Ident
    holders: set[Ident] = field(default_factory=set)
    pinned: bool = False  # lives whatever its holders do (an fd in flight, a leak that keeps its pid listed)
    leaks: bool = False  # on release the driver keeps its memory (a driver-level leak): no pid listed for it
    dead_since: float | None = None  # when the last holder was seen dead (the release latency runs from here)
    key: str = ""

    @property
    def owner_pid(self) -> int:
        return self.owner[0]


def context_gap(n: int, base: int = GAP_BASE, per: int = GAP_PER_CONTEXT) -> int:
    """What ``used`` holds beyond the per-process figures with ``n`` live contexts."""
    return 0 if n <= 0 else base + n * per


class DriverModel:
    """The driver's memory bookkeeping for a set of GPUs; ``alive(ident)`` says whether a holder still exists."""

    def __init__(self, clock: Clock, alive: Callable[[Ident], bool], minors: Iterable[int] = (0,), *,
                 gap_base: int = GAP_BASE, gap_per_context: int = GAP_PER_CONTEXT,
                 release_latency: float = RELEASE_LATENCY) -> None:
        self.clock = clock
        self.alive = alive
        self.minors = tuple(minors)
        self.gap_base = gap_base
        self.gap_per_context = gap_per_context
        self.release_latency = release_latency
        self.contexts: list[Context] = []
        self.leak: dict[int, int] = {}  # minor -> bytes no process holds or is listed for
        self.lost: set[int] = set()  # lost at enumeration: NVML cannot name them
        self.fail: dict[int, str] = {}  # minor -> error at read
        self.failed: list[str] = []  # what the last gpus() could not enumerate
        self.names: dict[int, GpuInfo] = {}

    # -- what the workloads do -----------------------------------------------------------------------------

    def open_context(self, gpu: int, nbytes: int, owner: Ident, *holders: Ident, pinned: bool = False, leaks: bool = False,
                     key: str = "") -> Context:
        c = Context(gpu, nbytes, owner, {owner, *holders}, pinned, leaks, key=key)
        self.contexts.append(c)
        return c

    def inherit(self, owner_pid: int, child: Ident) -> None:
        """A fork child inherits the owner's device fds: it keeps the context alive (and is never listed)."""
        for c in self.contexts:
            if c.owner_pid == owner_pid:
                c.holders.add(child)

    # -- what NVML shows ------------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        """Every GPU but a lost one; ``failed`` names each lost one (error per GPU, never a silent gap)."""
        self.failed = [f"GPU minor {m}: GPU is lost" for m in self.minors if m in self.lost]
        return [self.names.get(m) or GpuInfo(i, m, f"GPU-model-{m}", f"0000:{0x41 + m:02x}:00.0")
                for i, m in enumerate(self.minors) if m not in self.lost]

    def live(self) -> list[Context]:
        """The contexts the driver still holds now; released ones are dropped (after the latency)."""
        now = self.clock.monotonic()
        keep: list[Context] = []
        for c in self.contexts:
            if c.pinned or any(self.alive(h) for h in c.holders):
                c.dead_since = None
                keep.append(c)
                continue
            if c.dead_since is None:
                c.dead_since = now
            if now - c.dead_since < self.release_latency:
                keep.append(c)  # the holders are gone, the memory not yet: the dead owner is still listed
            elif c.leaks:
                self.leak[c.gpu] = self.leak.get(c.gpu, 0) + c.nbytes
        self.contexts = keep
        return keep

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        live = self.live()
        out: dict[int, GpuSample] = {}
        for m in minors:
            if m not in self.minors or m in self.lost:
                out[m] = GpuSample(m, None, None, "NVML: GPU not found" if m not in self.minors else "NVML: GPU is lost")
                continue
            if m in self.fail:
                out[m] = GpuSample(m, None, None, f"NVML: {self.fail[m]}")
                continue
            cs = [c for c in live if c.gpu == m]
            used = sum(c.nbytes for c in cs) + context_gap(len(cs), self.gap_base, self.gap_per_context) + self.leak.get(m, 0)
            rows: dict[int, int] = {}  # NVML lists one row per process, its contexts' memory summed (measured)
            for c in cs:
                rows[c.owner_pid] = rows.get(c.owner_pid, 0) + c.nbytes
            out[m] = GpuSample(m, used, tuple(NvmlProcess(pid, nbytes) for pid, nbytes in rows.items()))
        return out
