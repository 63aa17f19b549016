"""A GpuProbe whose every read is over within a deadline: a read stuck in the driver is abandoned, not waited for.

Each ``gpus()``/``sample()`` runs in a worker thread (``workers.Worker``: no ``threading`` import). If it has not returned after ``deadline`` seconds,
the caller gets, for ``sample()``, every asked GPU as unknown (``GpuSample(minor, None, None, "NVML read did
not return within X s")``, never zero) and, for ``gpus()``, a GpuQueryError. The stuck worker is left behind
(a thread in an uninterruptible driver call cannot be stopped); while it is stuck, later calls do not queue
behind it: they answer unknown at once, until it returns. Manual equivalent: ``timeout 5 nvidia-smi``.

Given an ``opener`` instead of a probe, the probe is opened by the first call, in that call's worker: NVML's own
start (``nvmlInit``, which can sit in the driver as any read can) is under the same deadline; ``start()`` opens it
now, a start that fails or does not return being a GpuQueryError.
"""

from __future__ import annotations

import _thread

from ..errors import GpuQueryError, PvegpuError
from ..model import GpuInfo, GpuSample
from .workers import Worker

TYPE_CHECKING = False  # typing is not imported at run time: ~3 ms of every reset's and audit's start-up
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, TypeVar

    T = TypeVar("T")
_HINT = "a GPU read is stuck in the driver: see `dmesg` for Xid errors and `nvidia-smi`; the GPU may need a reset"


class _Stuck(Exception):
    """The read did not return in time (or an earlier one is still stuck)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class BoundedProbe:
    """Wraps a GpuProbe (``inner``, or the one ``opener`` opens at the first call) so that no call takes longer than
    ``deadline`` seconds."""

    def __init__(self, inner: Any, deadline: float, *, opener: Callable[[], Any] | None = None) -> None:
        self.inner = inner
        self._opener = opener
        self.deadline = deadline
        self._lock = _thread.allocate_lock()
        self._busy: Worker | None = None  # a worker that has not returned yet

    def _run(self, fn: Callable[[], T], progress: Callable[[], int] | None = None) -> T:
        """``fn()`` in a worker, waited for ``deadline`` s; with ``progress`` (a count ``fn`` raises as it goes: one
        GPU read after another), the deadline starts again at each step, so every step has its own."""
        with self._lock:
            if self._busy is not None and self._busy.alive:
                raise _Stuck(f"an earlier NVML read has not returned after {self.deadline:g} s")
            worker = self._busy = Worker(fn)
        if progress is None:
            if not worker.join(self.deadline):
                raise _Stuck(f"NVML read did not return within {self.deadline:g} s")
        else:
            import time

            seen, until = 0, time.monotonic() + self.deadline
            while not worker.join(max(0.0, min(0.05, until - time.monotonic()))):
                if (now := progress()) > seen:
                    seen, until = now, time.monotonic() + self.deadline
                elif time.monotonic() >= until:
                    raise _Stuck(f"NVML read did not return within {self.deadline:g} s")
        if worker.error is not None:  # raised in the caller's thread
            raise worker.error
        return worker.value  # type: ignore[return-value]

    def _probe(self) -> Any:
        """The inner probe, opened now if it is not yet (in the worker of the call that needs it)."""
        if self.inner is None and self._opener is not None:
            self.inner = self._opener()
        return self.inner

    def start(self) -> None:
        """Open the inner probe now, bounded: a start that fails or does not return within the deadline is a
        GpuQueryError (what the opener raised, or that it is stuck)."""
        try:
            self._run(self._probe)
        except _Stuck as exc:
            raise GpuQueryError(f"NVML did not start: {exc.what}", _HINT) from None

    def gpus(self) -> list[GpuInfo]:
        """``nvidia-smi -L``, bounded: a stuck read is a GpuQueryError (exit 5)."""
        try:
            return self._run(lambda: self._probe().gpus())
        except _Stuck as exc:
            raise GpuQueryError(f"cannot list the GPUs: {exc.what}", _HINT) from None

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        """Memory and processes per GPU, bounded: a stuck read gives every asked GPU as unknown."""
        wanted = list(minors)
        try:
            return self._run(lambda: self._probe().sample(wanted))
        except _Stuck as exc:
            return {m: GpuSample(m, None, None, exc.what) for m in wanted}

    def health(self, minor: int) -> Any:
        """The inner probe's health reading (audit), bounded: a stuck read is a GpuQueryError."""
        try:
            return self._run(lambda: self._probe().health(minor))
        except _Stuck as exc:
            raise GpuQueryError(f"GPU minor {minor} health: {exc.what}", _HINT) from None

    def health_many(self, minors: Iterable[int]) -> dict[int, Any]:
        """Each GPU's health in one worker for them all (not one each: a thread's start and hand-back cost ~0.5-1 ms on
        a small VM), each GPU given ``deadline`` as ``health()`` gives it: the wait ends ``deadline`` after the last
        GPU's answer (or the start). A GPU whose reading failed, or had not come by then, is left out: the caller
        shows its health as unknown, as it shows a failed ``health()``; while it is stuck, later reads answer at once."""
        wanted = list(minors)
        got: dict[int, Any] = {}
        done = [0]  # GPUs answered or failed so far

        def read() -> None:
            probe = self._probe()
            for m in wanted:
                try:
                    got[m] = probe.health(m)
                except PvegpuError:  # this GPU's health is unknown; the others are still read
                    pass
                done[0] += 1

        try:
            self._run(read, progress=lambda: done[0])
        except _Stuck:  # those read by then are kept; an earlier read still stuck: none is read
            pass
        return dict(got)  # a copy: a worker past its deadline may still add to ``got``

    @property
    def failed(self) -> list[str]:
        """GPUs the inner probe's last ``gpus()`` left out, and why."""
        return list(getattr(self.inner, "failed", ()))

    @property
    def lost(self) -> dict[int, str]:
        """The same by NVML index (audit shows each as an error row)."""
        return dict(getattr(self.inner, "lost", {}))

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None and (self._busy is None or not self._busy.alive):
            close()
