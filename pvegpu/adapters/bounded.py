"""A GpuProbe whose every read is over within a deadline: a read stuck in the driver is abandoned, not waited for.

Each ``gpus()``/``sample()`` runs in a daemon thread. If it has not returned after ``deadline`` seconds, the caller
gets, for ``sample()``, every asked GPU as unknown (``GpuSample(minor, None, None, "NVML read did not return within
X s")``, never zero) and, for ``gpus()``, a GpuQueryError. The stuck thread is left behind (a thread in an
uninterruptible driver call cannot be stopped); while it is stuck, later calls do not queue behind it: they answer
unknown at once, until it returns. Manual equivalent: ``timeout 5 nvidia-smi``.

Given an ``opener`` instead of a probe, the probe is opened in a thread too, so NVML's own start (``nvmlInit``, which
can sit in the driver as any read can) is under the same deadline: by the first reading, or earlier by ``begin()``
(the opening runs while the caller reads configs and ``/proc``; the first reading waits for it within its own
deadline), or now by ``start()`` (a start that fails or does not return is a GpuQueryError).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pvegpu.core.errors import GpuQueryError, PvegpuError
from pvegpu.core.model import GpuHealth, GpuInfo, GpuSample

T = TypeVar("T")
_HINT = "a GPU read is stuck in the driver: see `dmesg` for Xid errors and `nvidia-smi`; the GPU may need a reset"


class _Stuck(Exception):
    """The read did not return in time (or an earlier one is still stuck)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _Call(threading.Thread):
    """``fn()`` in a daemon thread, started now (a call stuck in the driver never holds the process's exit):
    ``value`` is what it returned, ``error`` what it raised, for the caller to raise in its own thread."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(name="pvegpu-nvml", daemon=True)
        self._fn: Callable[[], Any] | None = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self._fn() if self._fn is not None else None
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise
            self.error = exc
        finally:
            self._fn = None

    def returned(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s; True once ``fn`` has returned."""
        self.join(max(0.0, timeout))
        return not self.is_alive()


class BoundedProbe:
    """Wraps a GpuProbe (``inner``, or the one ``opener`` opens) so that no call takes longer than ``deadline`` s."""

    def __init__(self, inner: Any, deadline: float, *, opener: Callable[[], Any] | None = None) -> None:
        self.inner: Any = inner
        self._opener = opener
        self.deadline = deadline
        self._lock = threading.Lock()
        self._busy: _Call | None = None  # the last call started (alive: it has not returned yet)
        self._opening: _Call | None = None  # begun by ``begin()``, not yet waited for by a reading

    def _probe(self) -> Any:
        """The inner probe, opened now if it is not yet (in the thread of the call that needs it)."""
        if self.inner is None and self._opener is not None:
            self.inner = self._opener()
        return self.inner

    def begin(self) -> None:
        """Start opening the inner probe now, in its thread, without waiting: the first reading waits for it."""
        with self._lock:
            idle = self._busy is None or not self._busy.is_alive()
            if self.inner is None and self._opener is not None and self._opening is None and idle:
                self._busy = self._opening = _Call(self._probe)

    def _run(self, fn: Callable[[], T], progress: Callable[[], int] | None = None) -> T:
        """``fn()`` in a thread, waited for ``deadline`` s; with ``progress`` (a count ``fn`` raises as it goes: one
        GPU read after another), the deadline starts again at each step, so every step has its own."""
        with self._lock:
            opening, self._opening = self._opening, None
        if opening is not None:  # the opening begun early: this reading waits for it, within its own deadline
            self._wait(opening, None)
        with self._lock:
            if self._busy is not None and self._busy.is_alive():
                raise _Stuck(f"an earlier NVML read has not returned after {self.deadline:g} s")
            call = self._busy = _Call(fn)
        return self._wait(call, progress)

    def _wait(self, call: _Call, progress: Callable[[], int] | None) -> Any:
        if progress is None:
            if not call.returned(self.deadline):
                raise _Stuck(f"NVML read did not return within {self.deadline:g} s")
        else:
            seen, until = 0, time.monotonic() + self.deadline
            while not call.returned(min(0.05, until - time.monotonic())):
                if (now := progress()) > seen:
                    seen, until = now, time.monotonic() + self.deadline
                elif time.monotonic() >= until:
                    raise _Stuck(f"NVML read did not return within {self.deadline:g} s")
        if call.error is not None:  # raised in the caller's thread
            raise call.error
        return call.value

    def start(self) -> None:
        """Open the inner probe now, bounded: a start that fails or does not return within the deadline is a
        GpuQueryError (what the opener raised, or that it is stuck)."""
        try:
            self._run(self._probe)
        except _Stuck as exc:
            raise GpuQueryError(f"NVML did not start: {exc.what}", _HINT) from None

    def gpus(self) -> list[GpuInfo]:
        """``nvidia-smi -L``, bounded: a stuck read, or NVML that cannot start, is a GpuQueryError (exit 5)."""
        try:
            return self._run(lambda: self._probe().gpus())
        except _Stuck as exc:
            raise GpuQueryError(f"cannot list the GPUs: {exc.what}", _HINT) from None

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        """Memory and processes per GPU, bounded: a stuck read, or NVML that cannot start, gives every asked GPU as
        unknown with the reason (never zero)."""
        wanted = list(minors)
        try:
            return self._run(lambda: self._probe().sample(wanted))
        except _Stuck as exc:
            return {m: GpuSample(m, None, None, exc.what) for m in wanted}
        except GpuQueryError as exc:
            return {m: GpuSample(m, None, None, exc.message) for m in wanted}

    def health(self, minor: int) -> GpuHealth:
        """The inner probe's health reading (audit), bounded: a stuck read is a GpuQueryError."""
        try:
            return self._run(lambda: self._probe().health(minor))
        except _Stuck as exc:
            raise GpuQueryError(f"GPU minor {minor} health: {exc.what}", _HINT) from None

    def nvlinks(self, minor: int) -> int | None:
        """The inner probe's count of active NVLinks, bounded: stuck, failing or not offered is unknown (None)."""
        try:
            return self._run(lambda: getattr(self._probe(), "nvlinks", lambda m: None)(minor))
        except (_Stuck, PvegpuError):
            return None

    def health_many(self, minors: Iterable[int]) -> dict[int, GpuHealth]:
        """Each GPU's health in one thread for them all, each GPU given ``deadline`` as ``health()`` gives it: the
        wait ends ``deadline`` after the last GPU's answer (or the start). A GPU whose reading failed, or had not
        come by then, is left out: the caller shows its health as unknown, as it shows a failed ``health()``; while
        it is stuck, later reads answer at once."""
        wanted = list(minors)
        got: dict[int, GpuHealth] = {}
        done = [0]  # GPUs answered or failed so far (written by the reading thread only)

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
        return dict(got)  # a copy: a thread past its deadline may still add to ``got``

    @property
    def failed(self) -> list[str]:
        """GPUs the inner probe's last ``gpus()`` left out, and why."""
        return list(getattr(self.inner, "failed", ()))

    @property
    def lost(self) -> dict[int, str]:
        """The same by NVML index (audit shows each as an error row)."""
        return dict(getattr(self.inner, "lost", {}))

    def close(self) -> None:
        """Close the inner probe (NVML shut down), unless a call is still stuck in it (NVML stays open under it; the
        process's exit closes it). With an ``opener``, a later reading opens it again."""
        with self._lock:
            opening, self._opening = self._opening, None
        if opening is not None:  # begun, never read: its NVML is closed like any other
            opening.returned(self.deadline)
        with self._lock:
            if self._busy is not None and self._busy.is_alive():
                return
            inner = self.inner
            if self._opener is not None:
                self.inner = None
        close = getattr(inner, "close", None)
        if close is not None:
            close()
