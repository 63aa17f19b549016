"""A whole-node holder scan spread over forked workers, one per core, with the serial scan as the fallback.

Manual equivalent: ``fuser -v /dev/nvidia*`` run over a share of ``/proc`` per core. The pids are cut into one
segment per worker; each worker is a fork of this process that scans its segment from the front with the very same
watched scan (``ProcHost._scan_watched``: per-process budget, stuck processes, the whole scan's deadline) and sends
its holdings back through a pipe; this process scans the segments from the back meanwhile, until it meets each
worker (``Split``). The merged result is what one serial scan gives. Rules:

- Bounded: at most ``MAX_WORKERS`` workers and never fewer than ``MIN_PER_WORKER`` pids each; a worker stops at the
  scan's own deadline (the rest of its share is unknown, as in a serial scan) and is given ``GRACE`` s more to report.
- Exact whatever the timing: where the two sides meet is only a hint (a page shared with the workers); each worker
  says how far it got, and what neither side scanned is scanned here before the merge.
- Any worker that fails (fork refused, killed, crashed, late, an unreadable answer) is killed and its share scanned
  again here, serially, within what is left of the deadline: never a hole in the answer, never a second deadline.
- A worker that answered is reaped once it has exited, not waited for (``reap_exited``: at the next split, or when
  the host's scans are done, ``ProcHost.cancel_prefetch``); it dies with this process in any case.
- A worker holds nothing of this process: it closes every inherited fd but its pipe (NVML's device fds included, so
  no other scan sees a pvegpu worker hold a GPU), takes the default action for every signal (a Ctrl-C never runs
  this process's handlers twice), touches no NVML, no API, no file but ``/proc``, and ends with ``os._exit``.
- Only from the main thread of a process with no other Python thread (fork copies one thread; a scan thread left
  stuck in the kernel by an earlier scan could hold a lock the child would need), else serial.
- Started ahead (``ProcHost.prefetch``, the audit): the workers scan while this process goes on; ``cancel()`` ends
  them when no reading takes the scan.
"""

from __future__ import annotations

import ctypes
import marshal
import mmap
import os
import select
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pvegpu.adapters.devscan import BUDGET
from pvegpu.core.model import Holding


class Scanner(Protocol):
    """What a share's scan needs of ``procfs.ProcHost`` (named here, not imported: no import cycle)."""

    _stuck: set[tuple[int, int]]

    def _scan_watched(self, todo: list[int], start: int, deep: bool, out: dict[int, Holding], end: float,
                      stop: Callable[[int], bool] | None = None) -> int: ...

    def _described_rows(self) -> list[tuple[object, ...]] | None: ...

    def _add_described(self, rows: list[tuple[object, ...]]) -> None: ...


MAX_WORKERS = 8  # forked workers at most, whatever the cores
MIN_PER_WORKER = 600  # pids per share at least: below that a fork costs more than it saves
GRACE = 1.0  # seconds past the scan's deadline a worker may take to hand its answer over
REAP_WAIT = 0.5  # seconds a worker that answered may take to exit before a reaper thread waits for it


def cores() -> int:
    """Cores this process may run on (its affinity mask, as ``nproc`` says), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def shares(count: int, limit: int | None = None) -> int:
    """How many shares a scan of ``count`` pids is cut into: one per core, each of ``MIN_PER_WORKER`` pids or more."""
    n = min(cores() if limit is None else limit, MAX_WORKERS + 1, count // MIN_PER_WORKER)
    return max(1, n)


def forkable() -> bool:
    """This process may fork scan workers now: from its main thread, with no other thread alive (a fork copies only
    the calling thread, and with it any lock another thread holds mid-way: a driver call, a bounded NVML read, a scan
    left stuck in the kernel). ``threading`` keeps its count of live threads under its own lock: nothing to race."""
    return threading.current_thread() is threading.main_thread() and threading.active_count() == 1


def scan(host: Scanner, todo: list[int], deep: bool, end: float, n: int) -> dict[int, Holding]:
    """Holdings of ``todo`` (in its order) from ``n`` shares: ``n - 1`` forked workers and this process."""
    return Split(host, todo, deep, end, n - 1).finish()


CHUNK = 16  # pids one side of a segment claims at a time (the most both sides may scan twice where they meet)
_SLOT = struct.Struct("=i")


class Split:
    """A whole-node scan cut into one segment per worker, each worker forked now and scanning its segment from the
    front; ``finish()`` (here, later) scans each segment from the back until it meets its worker, then merges.

    Where the two sides meet is found through a page shared with the workers (per segment: the worker's next
    unclaimed index, the lowest index claimed here). Those are hints only: each worker's answer says how far it
    got, and what neither side scanned (a late or failed worker, a stale hint) is scanned here before the merge,
    so the answer is the serial scan's whatever the hints said; a pid both sides scanned is only read twice.
    ``cancel()`` kills the workers when the scan is not wanted after all. Started before anything else is read
    (``ProcHost.prefetch``), the workers scan while this process imports, reads NVML and the configs."""

    def __init__(self, host: Scanner, todo: list[int], deep: bool, end: float, workers: int) -> None:
        reap_exited()  # the last split's workers, if still exiting: none accumulates

        self.host, self.todo, self.deep, self.end = host, todo, deep, end
        k = max(1, workers)
        cuts = [len(todo) * i // k for i in range(k + 1)]
        self.segments = list(zip(cuts, cuts[1:], strict=False))
        self.hints: mmap.mmap | bytearray
        try:
            self.hints = mmap.mmap(-1, 8 * k)  # anonymous and shared: the workers see what this process writes
        except OSError:  # no shared page (out of memory): hints only this process sees; still exact (gaps, overlap)
            self.hints = bytearray(8 * k)
        for i, (a, b) in enumerate(self.segments):
            _SLOT.pack_into(self.hints, 8 * i, a)
            _SLOT.pack_into(self.hints, 8 * i + 4, b)
        self.workers: list[tuple[int, int] | None] = []
        try:  # each worker is known here as soon as it is forked: an interrupt between two forks leaves none unknown
            for i, (a, b) in enumerate(self.segments):
                self.workers.append(_start(host, todo[a:b], deep, end, _ahead(self.hints, i, a)))
        except BaseException:
            self.cancel()
            raise

    def finish(self) -> dict[int, Holding]:
        """The holdings of every pid of ``todo``, in its order (what one serial scan gives). Interrupted (Ctrl-C, any
        error), it kills and reaps the workers before the exception goes on."""
        try:
            return self._finish()
        except BaseException:
            self.cancel()
            raise

    def _finish(self) -> dict[int, Holding]:
        here: dict[int, Holding] = {}
        lows = [b for _a, b in self.segments]
        for i, (a, b) in enumerate(self.segments):
            if self.workers[i] is None:
                continue  # not started: its segment is scanned whole below
            done = _serial(self.host, self.todo[a:b][::-1], self.deep, self.end, here, _behind(self.hints, i, b))
            lows[i] = b - done
        out: dict[int, Holding] = {}
        for i, (a, _b) in enumerate(self.segments):
            w, self.workers[i] = self.workers[i], None  # collected (or failed and reaped): never cancelled again
            got = _collect(self.host, w, self.end + GRACE, a) if w is not None else None
            upto = a
            if got is not None:
                rows, upto = got
                _merge(out, rows)
            if upto < lows[i]:  # not scanned by either side (a failed worker, a stale hint): here, within the deadline
                _serial(self.host, self.todo[upto:lows[i]], self.deep, self.end, here)
        _merge(out, here)
        self.workers = []
        return {p: out[p] for p in self.todo if p in out}

    def cancel(self) -> None:
        """Kill and reap the workers (the scan is not wanted)."""
        workers, self.workers = self.workers, []
        for w in workers:
            if w is not None:
                try:
                    os.close(w[1])
                finally:
                    _reap(w[0], kill=True)


def _merge(out: dict[int, Holding], more: dict[int, Holding]) -> None:
    """``more`` into ``out``. A pid both sides read keeps a reading over "not reached before the deadline"; two
    readings that are both unknown keep every GPU and reason either saw (one may have found the GPU before its
    process's budget ran out): a GPU seen is never dropped."""
    for p, h in more.items():
        old = out.get(p)
        if old is None or (BUDGET in old.via and BUDGET not in h.via):
            out[p] = h
        elif BUDGET in h.via and BUDGET in old.via:
            out[p] = Holding(p, old.minors | h.minors, old.via | h.via,
                             None if old.mapped is None or h.mapped is None else old.mapped | h.mapped)
        elif BUDGET not in h.via:
            out[p] = h


def _ahead(hints: object, i: int, a: int) -> Callable[[int], bool]:
    """A worker's stop rule for its segment (starting at ``a``), read front to back: before index ``j`` of it,
    stop when this process has claimed it; else claim the next ``CHUNK`` (the next unclaimed index, in the hints)."""
    claimed = [a]

    def stop(j: int) -> bool:
        f = a + j
        if f < claimed[0]:
            return False
        low = _SLOT.unpack_from(hints, 8 * i + 4)[0]  # type: ignore[arg-type]
        if f >= low:
            return True
        claimed[0] = min(f + CHUNK, low)
        _SLOT.pack_into(hints, 8 * i, claimed[0])  # type: ignore[arg-type]
        return False

    return stop


def _behind(hints: object, i: int, b: int) -> Callable[[int], bool]:
    """This process's stop rule for segment ``i`` (ending at ``b``), read back to front: before index ``r`` of the
    reversed segment, stop when the worker has claimed it; else claim down to ``CHUNK`` more (never past the worker)."""
    claimed = [b]

    def stop(r: int) -> bool:
        f = b - 1 - r
        if f >= claimed[0]:
            return False
        nxt = _SLOT.unpack_from(hints, 8 * i)[0]  # type: ignore[arg-type]
        if f < nxt:
            return True
        claimed[0] = max(f + 1 - CHUNK, nxt)
        _SLOT.pack_into(hints, 8 * i + 4, claimed[0])  # type: ignore[arg-type]
        return False

    return stop


def _serial(host: Scanner, part: list[int], deep: bool, end: float, out: dict[int, Holding],
            stop: Callable[[int], bool] | None = None) -> int:
    """Scan ``part`` into ``out`` in order, until ``stop(index)`` says so; how many pids were scanned (from the front)."""
    start = 0
    while start < len(part) and not (stop is not None and stop(start)):
        start = host._scan_watched(part, start, deep, out, end, stop)
    return start


def _start(host: Scanner, part: list[int], deep: bool, end: float,
           stop: Callable[[int], bool] | None = None) -> tuple[int, int] | None:
    """Fork one worker for ``part``; (its pid, the read end of its pipe), None when it cannot be started."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    parent = os.getpid()
    _prctl()  # resolved before the fork: the worker only calls it
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # none arrives between fork and reset
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the worker: nothing of the parent's but /proc, and os._exit whatever happens
        code = 1
        try:
            _die_with(parent)
            _worker(host, part, deep, end, w, r, mask, stop)
            code = 0
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(w)
    return pid, r


_PR_SET_PDEATHSIG = 1
_PRCTL: list[Callable[..., int] | None] = []


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up once (None without one)."""
    if not _PRCTL:
        try:
            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError):
            _PRCTL.append(None)
    return _PRCTL[0]


def _die_with(parent: int) -> None:
    """In a worker, signals still blocked: be killed when this process's parent ends, however it ends (SIGTERM,
    SIGHUP, SIGKILL reach pvegpu alone when systemd, ``timeout`` or ``kill`` send them); and end now if it already has."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _worker(host: Scanner, part: list[int], deep: bool, end: float, w: int, r: int, mask: set[int | signal.Signals],
            stop: Callable[[int], bool] | None = None) -> None:
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, TypeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what arrived meanwhile takes its default action now
    os.close(r)
    os.closerange(3, w)  # NVML's /dev/nvidia* fds, locks, sockets: the worker holds none of them
    os.closerange(w + 1, 1 << 20)
    out: dict[int, Holding] = {}
    done = _serial(host, part, deep, end, out, stop)
    rows = [(h.pid, sorted(h.minors), sorted(h.via), None if h.mapped is None else sorted(h.mapped)) for h in out.values()]
    data = marshal.dumps((rows, sorted(host._stuck), done, host._described_rows()))
    view = memoryview(data)
    while view:
        view = view[os.write(w, view):]
    os.close(w)


def _collect(host: Scanner, worker: tuple[int, int], deadline: float, first: int = 0) -> tuple[dict[int, Holding], int] | None:
    """The worker's holdings and the index of ``todo`` it got to (its segment starting at ``first``), or None: it
    failed, or did not answer by ``deadline`` (then it is killed). The worker closes its pipe only after the whole
    answer, so end of file plus an answer that decodes is success."""
    pid, r = worker
    chunks: list[bytes] = []
    ended = False
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                ended = True
                break
            chunks.append(chunk)
    except OSError:
        ended = False
    finally:
        os.close(r)
    if not ended:
        _reap(pid, kill=True)
        return None
    try:
        rows, stuck, done, described = marshal.loads(b"".join(chunks))
        got = {int(p): Holding(int(p), frozenset(int(m) for m in minors), frozenset(str(v) for v in via),
                               None if mapped is None else frozenset(int(m) for m in mapped))
               for p, minors, via, mapped in rows}
        stuck_ids = {(int(a), int(b)) for a, b in stuck}
        upto = first + int(done)
    except (EOFError, ValueError, TypeError):  # it died before or while writing: nothing it says is taken
        _reap(pid, kill=True)  # a failed worker is ended and waited for, whatever it is still doing
        return None
    _reap_later(pid)  # it answered and is exiting (its address space torn down): no wait for that here
    host._stuck.update(stuck_ids)
    if described:
        host._add_described(described)
    return got, upto


_EXITING: list[int] = []  # workers that answered and are exiting, not reaped yet (``reap_exited``)


def _reap_later(pid: int) -> None:
    """Reap a worker that answered if it has exited already, else leave it to ``reap_exited()``: the next split
    scan, or the host's ``cancel_prefetch()`` (the audit's ``done()``), whichever comes first."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return
    if not done:
        _EXITING.append(pid)


def reap_exited() -> None:
    """Reap the workers that answered and were still exiting (each within ``REAP_WAIT``, as ``_reap``)."""
    while _EXITING:
        _reap(_EXITING.pop(), kill=False)


def _reap(pid: int, kill: bool) -> None:
    """Reap the worker (killed first when it has not answered). One that does not exit within a moment (a thread
    of it blocked in the kernel) is left to a reaper thread; later scans of this run are then serial (``forkable``)."""
    if kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + REAP_WAIT
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > end:
            break
        time.sleep(0.001)
    threading.Thread(target=_wait, args=(pid,), name="pvegpu-reaper", daemon=True).start()


def _wait(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
