"""A real CUDA memory holder with nothing but the standard library: ctypes over libcuda.so.1.

    python3 bench/cuda_hold.py --gib 20 --ready /tmp/r/ready [--ignore-term] [--term-file F] [--fork-after-init] [--workers 3]

cuInit, the device's primary context, cuMemAlloc in 1 GiB pieces (what ``torch.empty(..., device='cuda')``
does underneath), then touch the ready file and sleep until killed. Manual equivalent: any CUDA program
that allocates and waits; ``nvidia-smi --query-compute-apps=pid,used_memory`` lists it.
--fork-after-init: fork after the allocation; the parent (leading its own session, as a service does) exits, the
child keeps the inherited context (NVML does not list it) and the parent's pid as its session id, the link that
proves whose the dead parent's memory is. --workers N: N spawned worker processes share the memory (multiprocessing
'spawn', as torch.multiprocessing does); the parent holds no context. --term-file F: each SIGTERM is written to F and
the memory kept; a handler, so that it reaches a holder that is PID 1 of its namespace too (the kernel drops an
unhandled SIGTERM sent to it from outside): a test sees whether anything tried to stop it by signal.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import time

GIB = 1 << 30


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"cuda_hold: {what} failed with CUresult {rc}")


def hold(gib: float, ordinal: int = 0) -> list[int]:
    """Allocate gib GiB on the device; returns the device pointers (kept alive by the caller)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    _check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    left, ptrs = int(gib * GIB), []
    while left > 0:
        n = min(left, GIB)
        p = ctypes.c_uint64()
        _check(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), f"cuMemAlloc of {n} bytes")
        ptrs.append(p.value)
        left -= n
    return ptrs


def touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def _note(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def _worker(gib: float, ready: str) -> None:
    _keep = hold(gib)  # noqa: F841 (held until the process dies)
    touch(ready)
    sleep_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, required=True)
    ap.add_argument("--ready", required=True, help="file to create once the memory is held")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--term-file", help="append a line here on each SIGTERM, and keep holding")
    ap.add_argument("--fork-after-init", action="store_true")
    ap.add_argument("--workers", type=int, default=0)
    a = ap.parse_args()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.term_file:
        signal.signal(signal.SIGTERM, lambda _n, _f: _note(a.term_file, "SIGTERM"))
    if a.workers:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(a.gib / a.workers, f"{a.ready}.{i}")) for i in range(a.workers)]
        for p in procs:
            p.start()
        sleep_forever()
    _keep = hold(a.gib)  # noqa: F841
    if a.fork_after_init:
        parent = os.getpid()
        try:
            os.setsid()
        except PermissionError:  # already a group leader: the child keeps that group's id, the same link
            pass
        if os.fork():
            os._exit(0)
        end = time.monotonic() + 10
        while os.getppid() == parent and time.monotonic() < end:  # wait until the parent is gone
            time.sleep(0.01)
    touch(a.ready)
    sleep_forever()


if __name__ == "__main__":
    main()
