"""Wait for a Proxmox task to end: the one polling loop behind every ``PveApi.wait_task``.

Manual equivalent: ``pvesh get /nodes/<node>/tasks/<upid>/status`` until ``status`` is ``stopped``,
then ``pvesh get /nodes/<node>/tasks/<upid>/log`` when ``exitstatus`` is not ``OK``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pvegpu.core.errors import PvegpuError, TaskFailed, TaskTimeout
from pvegpu.core.model import TaskResult
from pvegpu.core.ports import Clock
from pvegpu.core.safetext import escape

LOG_TAIL = 10  # log lines kept with a failed or timed-out task
SHOWN = 500  # characters kept of an exitstatus or a log line, after escaping (both are remote text)
POLL = 0.2  # seconds between status reads


def wait_task(
    status: Callable[[], Mapping[str, Any]],
    log: Callable[[], list[str]],
    clock: Clock,
    *,
    node: str,
    upid: str,
    timeout: float,
    what: str,
    poll: float = POLL,
    progress: Callable[[str], None] | None = None,
) -> TaskResult:
    """Poll ``status()`` until the task stops, for at most ``timeout`` seconds of ``clock``.

    Returns the TaskResult for OK and ``WARNINGS: n``; raises TaskFailed for any other exitstatus and
    TaskTimeout when the deadline passes first, both with the log tail. A status read that fails
    raises its own PveApiError (the caller finds out what happened to the guest). Elapsed time is
    measured after each read, so a slow read cannot stretch the wait past ``timeout`` by more than itself.
    """
    start = clock.monotonic()
    deadline, said = start + max(0.0, timeout), start
    while True:
        st = status()
        if st.get("status") == "stopped":
            break
        now = clock.monotonic()
        left = deadline - now
        if progress is not None and now - said >= (1.0 if said == start else 5.0):  # after 1 s, then every 5 s
            said = now
            progress(f"waiting for the {what}: {now - start:.0f} s of {timeout:g}")
        if left <= 0:
            message, tail = _with_log(f"{what} still running after {timeout:g} s ({upid})", log)
            raise TaskTimeout(message, f"it may still finish: `pvesh get /nodes/{node}/tasks/{upid}/status`; "
                              "raise reset.task_timeout if such tasks are normal here", tail)
        clock.sleep(min(poll, left))
    exitstatus = escape(str(st.get("exitstatus") or "no exit status"), SHOWN)  # a guest's own text can end up here
    if exitstatus == "OK":
        return TaskResult(upid, exitstatus)
    if exitstatus.startswith("WARNINGS"):
        _, tail = _with_log("", log)
        return TaskResult(upid, exitstatus, tail)
    message, tail = _with_log(f"{what} failed: {exitstatus}", log)
    raise TaskFailed(message, _failure_hint(node, upid, exitstatus), tail)


def _with_log(message: str, log: Callable[[], list[str]]) -> tuple[str, tuple[str, ...]]:
    """The log tail for a message; a log that cannot be read is added to the message, never replaces it."""
    try:
        lines = log()
    except PvegpuError as exc:
        return (f"{message} (its log could not be read: {exc.message})" if message else message), ()
    return message, tuple(escape(str(line), SHOWN) for line in list(lines)[-LOG_TAIL:])


def _failure_hint(node: str, upid: str, exitstatus: str) -> str:
    vmid = upid_id(upid)
    if "hookscript" in exitstatus and vmid:
        return f"the container's hookscript refused (a start gate?): run `pvegpu check {vmid}` for the reason"
    return f"the whole log: `pvesh get /nodes/{node}/tasks/{upid}/log`"


def upid_id(upid: str) -> str:
    """The guest id field of ``UPID:node:pid:pstart:starttime:type:id:user:`` ('' when absent)."""
    parts = upid.split(":")
    return parts[6] if len(parts) > 7 and parts[0] == "UPID" else ""

