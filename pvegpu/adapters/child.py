"""Run a function in a forked child under a deadline, answered over a private pipe.

The start gate uses it so that a check stuck in the driver (a process in D state inside NVML) holds neither
pvegpu nor PVE's output pipe: on expiry the parent answers, kills the child, and exits.
"""

from __future__ import annotations

import marshal
import os
import select
import time
from collections.abc import Callable
from typing import Any

from pvegpu.core.errors import PvegpuError


def call_in_child(fn: Callable[[], Any], deadline: float) -> tuple[bool, dict[str, Any] | None]:
    """(finished, answer). The answer is ``{"ok": result}`` (JSON-able: it arrives as JSON would bring it, tuples as
    lists and keys as strings), ``{"error": PvegpuError.to_json()}`` for a PvegpuError, or ``{"crash": "Type: text"}``.
    The child's stdio goes to /dev/null."""
    return Child(fn).result(deadline)


class Child:
    """``fn`` running in a forked child from now on; ``result(deadline)`` collects its answer, the deadline
    counted from the fork. The start gate forks first and reads its settings meanwhile (``pvegpu/cli/hook.py``)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.started = time.monotonic()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            _run_child(fn, r, w)
        os.close(w)
        self.pid, self.fd = pid, r

    def left(self, deadline: float) -> float:
        """Seconds left of ``deadline`` counted from this fork (0 when it is over): what a later wait may still use."""
        return max(0.0, self.started + deadline - time.monotonic())

    def cancel(self) -> None:
        """Not needed after all: killed (never waited for: it may sit in the driver; init reaps it)."""
        if self.fd < 0:
            return
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        os.close(self.fd)
        self.fd = -1

    def result(self, deadline: float, *, reap: bool = True) -> tuple[bool, dict[str, Any] | None]:
        """(finished, answer) as ``call_in_child`` gives them; on expiry the child is killed. ``reap=False``: once
        the answer is in, the child's exit is not waited for (the kernel closing its NVML files takes a few ms on the
        H200): for a caller that exits right after (the start gate), whose child init then reaps."""
        r, pid = self.fd, self.pid
        chunks: list[bytes] = []
        end = self.started + deadline
        try:
            while True:
                left = end - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                    return False, None
                data = os.read(r, 65536)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(r)
            self.fd = -1
        _reap(pid, end if reap else 0.0)  # the pipe at EOF is not the child gone: its exit can sit in the driver
        if not chunks:
            return True, {"crash": "the check ended without an answer"}
        try:
            return True, dict(marshal.loads(b"".join(chunks)))
        except (EOFError, ValueError, TypeError):
            return True, {"crash": "the check's answer could not be read"}


def _reap(pid: int, end: float) -> None:
    """Reap the child if it exits before ``end``; never wait past it (then init reaps it after this process)."""
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() >= end:
                return
        except ChildProcessError:
            return
        time.sleep(0.001)


def _run_child(fn: Callable[[], Any], r: int, w: int) -> None:
    code = 0
    try:
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            out: dict[str, Any] = {"ok": fn()}
        except PvegpuError as exc:
            out = {"error": exc.to_json()}
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            out = {"crash": f"{type(exc).__name__}: {exc}"}
        try:
            data = marshal.dumps(plain(out))
        except (TypeError, ValueError) as exc:
            data = marshal.dumps({"crash": f"{type(exc).__name__}: {exc}"})
        _write_all(w, data)
        os.close(w)  # the answer is complete: the parent sees its end now, not when this process has exited (closing
        # NVML's files at exit takes a while)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def plain(x: Any) -> Any:
    """``x`` as JSON would carry it, in built-in types only, for ``marshal`` (which refuses subclasses of the built-in
    types): str/int/float subclasses (``StrEnum`` members) as their base type, tuples as lists, dict keys as JSON
    writes them (``1`` -> ``"1"``, ``True`` -> ``"true"``, ``None`` -> ``"null"``). Anything else is a TypeError."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, int):  # the base type's own conversion, as json writes them: not a subclass's __str__/__int__
        return int.__int__(x)  # (a (str, Enum) member's str() is "Class.NAME", json writes its value)
    if isinstance(x, float):
        return float.__float__(x)
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, dict):
        return {_key(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _key(k: Any) -> str:
    if isinstance(k, str):
        return str.__str__(k)
    if k is True or k is False:
        return "true" if k else "false"
    if k is None:
        return "null"
    if isinstance(k, int):
        return int.__repr__(k)
    if isinstance(k, float):
        return float.__repr__(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")
