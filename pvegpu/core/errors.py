"""One error hierarchy; each error carries its exit code and a hint for the admin.

Errors render themselves (click's model): ``exc.render()`` gives the ``Error: ...`` / ``Hint: ...`` lines,
``exc.to_json()`` the ``--json`` object, ``exc.inline()`` one line for a PVE task log, and ``exc.show(err, out)``
prints them as every command does; the CLI (``cli.main``), ``__main__`` and the hook all go through these, and exit with
``exit_code``. Library code never calls ``sys.exit``.
"""

from __future__ import annotations

from typing import ClassVar, TextIO

from pvegpu.core.contract import dumps

# Exit codes (documented in README.md, "Exit codes").
EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected internal error
EXIT_USAGE = 2  # bad command line, settings or input; run as a user where only root may read (NeedsRootError)
EXIT_NOT_FOUND = 3  # vmid unknown, a VM, or on another node
EXIT_PVE = 4  # Proxmox API / task failure (incl. lock, hookscript refusal)
EXIT_GPU_UNKNOWN = 5  # a GPU could not be read (NVML missing, GPU lost)
EXIT_HOLDERS_LEFT = 6  # container processes still hold the GPU (survivors, D state, respawn)
EXIT_MEMORY_LEFT = 7  # memory still held with no holder in the container (leak / outside holder)
EXIT_AUDIT_ATTENTION = 8  # something needs attention: audit findings, hook status, hook install/uninstall refusals
EXIT_BUSY = 9  # another pvegpu reset of the same container is running
EXIT_REFUSED = 10  # the start gate refuses
EXIT_GPU_RESET_REFUSED = 11  # gpu-reset refused: a client will not let go, NVLink/Fabric Manager, a VM owns it, no reset for it
EXIT_GPU_RESET_FAILED = 12  # gpu-reset: the reset failed or timed out, or NVML says the GPU is not back (memory, recovery action)


class PvegpuError(Exception):
    """An error meant for the user: one line of message, an optional hint, an exit code."""

    exit_code: ClassVar[int] = EXIT_FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self, prefix: str = "") -> str:
        """The one rendering for people: ``Error: ...`` and ``Hint: ...`` lines (``prefix`` first on each, e.g.
        ``pvegpu: `` in a PVE task log)."""
        lines = [f"{prefix}Error: {self.message}"]
        if self.hint:
            lines.append(f"{prefix}Hint: {self.hint}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        """The same error for ``--json`` consumers (and across the gate's pipe: ``from_json`` reads it back)."""
        return {"error": self.message, "hint": self.hint, "exit_code": self.exit_code}

    @staticmethod
    def from_json(doc: dict[str, object]) -> PvegpuError:
        """An error that crossed a process boundary as ``to_json()``, with its exit code (``Relayed``)."""
        hint = doc.get("hint")
        code = doc.get("exit_code")
        return Relayed(str(doc.get("error")), None if hint is None else str(hint), code if isinstance(code, int) else EXIT_FAILURE)

    def inline(self, hint_label: str = "hint") -> str:
        """One line: the message, then ``(hint_label: hint)`` when there is a hint (a task log's refusal line)."""
        return self.message + (f" ({hint_label}: {self.hint})" if self.hint else "")

    def show(self, err: TextIO, out: TextIO | None = None, prefix: str = "") -> int:
        """Say it as every command does: the JSON object on ``out`` when given (a ``--json`` run), the rendering on
        ``err`` (the person watching still gets the message); returns the exit code."""
        if out is not None:
            print(dumps(self.to_json()), file=out)
        print(self.render(prefix), file=err)
        return self.exit_code


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


class NeedsRootError(UsageError):
    """A user other than root ran pvegpu where only root may read or change what it needs (``/etc/pve``'s guest
    configs, root's simulated node): one line saying to run it as root, exit 2 (never "pmxcfs down", never internal)."""

    def __init__(self, path: str, uid: int, doing: str = "read") -> None:
        super().__init__(f"permission denied to {doing} {path} as uid {uid}: pvegpu must run as root on a "
                         "Proxmox VE node", "run it as root (root's shell on the node, or `sudo pvegpu ...`)")
        self.path = path


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


def internal(exc: BaseException) -> PvegpuError:
    """An exception nothing expected, as the one line a user sees (``PVEGPU_DEBUG=1`` shows the traceback instead)."""
    return PvegpuError(f"internal error: {type(exc).__name__}: {exc}",
                       "please report it with the command line; PVEGPU_DEBUG=1 shows the traceback")


def render(exc: PvegpuError, prefix: str = "") -> str:
    """``exc.render(prefix)`` (kept for callers of the function)."""
    return exc.render(prefix)


def to_json(exc: PvegpuError) -> dict[str, object]:
    """``exc.to_json()`` (kept for callers of the function)."""
    return exc.to_json()
