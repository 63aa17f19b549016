"""A scan forks workers only when no other thread is alive (``scanpool.forkable``): a fork copies one thread, and
with it any lock another thread holds mid-way (a driver call, a bounded NVML read, a scan stuck in the kernel)."""

from __future__ import annotations

import os
import sys
import threading

from pvegpu.adapters import scanpool
from pvegpu.adapters.bounded import BoundedProbe
from pvegpu.core.model import GpuSample


class _Quick:
    """A GpuProbe that answers at once."""

    def sample(self, minors):
        return {m: GpuSample(m, 0, ()) for m in minors}


def test_a_running_thread_keeps_the_process_from_forking():
    """While another thread runs, forkable() says no; once it has ended, yes again."""
    gate = threading.Event()
    before = scanpool.forkable()
    t = threading.Thread(target=gate.wait, args=(30,), daemon=True)
    t.start()
    try:
        assert not scanpool.forkable()
    finally:
        gate.set()
    t.join(5)
    assert scanpool.forkable() == before


def test_many_reads_in_many_threads_lose_no_count():
    """Bounded reads started and ended in four threads at once, thread switches as often as the interpreter allows,
    while one read is stuck in the driver: forkable() is False throughout and after them (the stuck read lives), and
    True once it has returned (a lost update of a shared count would leave it wrong one way or the other)."""
    release = threading.Event()

    class Stuck:
        def sample(self, minors):
            release.wait(30)
            return {m: GpuSample(m, 0, ()) for m in minors}

    before = scanpool.forkable()  # True unless an earlier test left a thread behind
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    seen: list[bool] = []
    stuck = BoundedProbe(Stuck(), deadline=0.05)
    try:
        assert not stuck.sample([0])[0].known  # abandoned: its thread is still in the "driver"

        def reads() -> None:
            b = BoundedProbe(_Quick(), deadline=5)
            for _ in range(200):
                if b.sample([0])[0].known:
                    seen.append(scanpool.forkable())

        workers = [threading.Thread(target=reads) for _ in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert len(seen) == 800 and not any(seen)
        assert not scanpool.forkable()
        release.set()
        assert stuck._busy is not None and stuck._busy.returned(5)
        assert scanpool.forkable() == before
    finally:
        sys.setswitchinterval(old)
        release.set()


def test_a_forked_child_may_fork_though_its_parent_had_a_thread():
    """In a child forked while a thread runs, only the forking thread lives on: the child may fork its scan workers."""
    gate = threading.Event()
    t = threading.Thread(target=gate.wait, args=(30,), daemon=True)
    t.start()
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"1" if scanpool.forkable() else b"0")
            os._exit(0)
        os.close(w)
        answer = os.read(r, 1)
        os.waitpid(pid, 0)
        os.close(r)
        assert answer == b"1" and not scanpool.forkable()
    finally:
        gate.set()
        t.join(5)
