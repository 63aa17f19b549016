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
EXIT_AUDIT_ATTENTION = 8  # `pvegpu audit`: something needs attention (flags listed with advice)
EXIT_REFUSED = 10  # the start gate refuses


class PvegpuError(Exception):
    """An error meant for the user: one line of message, an optional hint, an exit code."""

    exit_code: ClassVar[int] = EXIT_FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


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


class TaskFailed(PveApiError):
    """A PVE task ended with an exitstatus other than OK (log tail attached)."""

    def __init__(self, message: str, hint: str | None = None, log_tail: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint)
        self.log_tail = log_tail


class TaskTimeout(PveApiError):
    """A PVE task did not finish within its deadline."""


class GpuQueryError(PvegpuError):
    """NVML could not be read: the answer is unknown, never zero."""

    exit_code = EXIT_GPU_UNKNOWN
