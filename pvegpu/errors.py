"""One error hierarchy; each error carries its exit code and a hint for the admin.

The CLI and the hook render these as ``Error: ...`` / ``Hint: ...`` and exit with ``exit_code``.
Library code never calls ``sys.exit``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from typing import ClassVar

# Exit codes (documented in README.md, "Exit codes").
EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected internal error
EXIT_USAGE = 2  # bad command line, settings or input
EXIT_NOT_FOUND = 3  # vmid unknown, a VM, or on another node
EXIT_PVE = 4  # Proxmox API / task failure (incl. lock, hookscript refusal)
EXIT_GPU_UNKNOWN = 5  # a GPU could not be read (NVML missing, GPU lost)
EXIT_HOLDERS_LEFT = 6  # container processes still hold the GPU (survivors, D state, respawn)
EXIT_MEMORY_LEFT = 7  # memory still held with no holder in the container (leak / outside holder)
EXIT_AUDIT_ATTENTION = 8  # something needs attention: audit findings, hook status, hook install/uninstall refusals
EXIT_BUSY = 9  # another pvegpu reset of the same container is running
EXIT_REFUSED = 10  # the start gate refuses


class PvegpuError(Exception):
    """An error meant for the user: one line of message, an optional hint, an exit code."""

    exit_code: ClassVar[int] = EXIT_FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class Relayed(PvegpuError):
    """An error that crossed a process boundary (the gate's bounded child) with its exit code."""

    def __init__(self, message: str, hint: str | None, exit_code: int) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code  # type: ignore[misc]


class UsageError(PvegpuError):
    """Bad input: an argument, a vmid, a setting."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """The settings file or environment is invalid (all problems listed at once)."""


class NotFoundError(PvegpuError):
    """The guest does not exist, is a VM, or lives on another node."""

    exit_code = EXIT_NOT_FOUND


class PveApiError(PvegpuError):
    """A Proxmox API call failed, or a task it started did not end OK."""

    exit_code = EXIT_PVE


class PveNoAnswer(PveApiError):
    """A request was (or may have been) sent, but no answer came back (read timeout, connection dropped, pvesh
    killed at its deadline): what it asked for, a stop say, may still happen."""


class TaskError(PveApiError):
    """A PVE task did not end OK; ``log_tail`` holds the last lines of its log (may be empty)."""

    def __init__(self, message: str, hint: str | None = None, log_tail: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint)
        self.log_tail = log_tail


class TaskFailed(TaskError):
    """A PVE task ended with an exitstatus other than OK or WARNINGS."""


class TaskTimeout(TaskError):
    """A PVE task did not finish within its deadline (it may still be running)."""


class NotPveNodeError(NotFoundError):
    """Neither ``/etc/pve`` nor a configured API: there is no Proxmox VE to ask (one message for every command)."""

    def __init__(self, pve_root: str = "/etc/pve") -> None:
        super().__init__(f"not a Proxmox VE node: {pve_root}/.vmlist not found and no API configured",
                         "run it as root on a PVE node, set api.host and an API token (README 'API token'), or try `pvegpu demo`")


class PmxcfsDownError(PveApiError):
    """``/etc/pve`` is there but empty: the node's cluster filesystem (pmxcfs) is not mounted."""

    def __init__(self, pve_root: str = "/etc/pve") -> None:
        super().__init__(f"{pve_root} is empty: Proxmox VE's cluster filesystem (pmxcfs) is not mounted, so no guest "
                         "configuration can be read", "`systemctl status pve-cluster`; `journalctl -u pve-cluster` says why it stopped")


class SignalledError(PvegpuError):
    """A signal ended the command before anything needed finishing; exits 128 + the signal's number."""

    def __init__(self, message: str, hint: str | None, exit_code: int) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code  # type: ignore[misc]


class BusyError(PvegpuError):
    """Another pvegpu reset of the same container holds its lock."""

    exit_code = EXIT_BUSY


class GpuQueryError(PvegpuError):
    """NVML could not be read: the answer is unknown, never zero."""

    exit_code = EXIT_GPU_UNKNOWN


def render(exc: PvegpuError, prefix: str = "") -> str:
    """The one rendering of an error for people: ``Error: ...`` and ``Hint: ...`` lines (``prefix`` first,
    e.g. ``pvegpu: `` in a PVE task log)."""
    lines = [f"{prefix}Error: {exc.message}"]
    if exc.hint:
        lines.append(f"{prefix}Hint: {exc.hint}")
    return "\n".join(lines)


def to_json(exc: PvegpuError) -> dict[str, object]:
    """The same error for ``--json`` consumers."""
    return {"error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code}
