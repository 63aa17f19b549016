"""How an interrupted reset ended, for a container or a VM (``vmreset`` shares it): pure, no dependencies."""

from __future__ import annotations


def interruption(kind: str, vmid: int, state: str | None, *, restarted: bool, left_stopped: bool, start_requested: bool,
                 abandoned: bool, restart: str = "restart") -> tuple[bool, str, str]:
    """How an interrupted reset ended, for a CT or a VM (``kind``): (left stopped?, what pvegpu did, where the guest
    is). First signal: the ``restart`` was finished before this; second (``abandoned``): pvegpu stopped where it was."""
    if abandoned:
        known = state or "unknown"
        left = not (restarted and known == "running")
        where = (f"{kind} {vmid} is running" if not left else
                 f"{kind} {vmid} may be STOPPED (last known: {known}; its start was {'requested' if start_requested else 'never requested'})")
        return left, f"abandoned the {restart} at the second signal", where
    where = (f"{kind} {vmid} is running" if state == "running" and not left_stopped
             else f"{kind} {vmid} was left STOPPED" if state == "stopped"
             else f"{kind} {vmid} is {state or 'in an unknown state'}" + (" and may end up stopped" if left_stopped else ""))
    return left_stopped, f"finished the {restart} before exiting", where
