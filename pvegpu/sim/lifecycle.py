"""Making a simulated node for a person: ``pvegpu sim create DIR [--scenario NAME]`` and ``pvegpu demo``.

``create`` does every check and every step (the command functions only print what it returns): the scenario by
name or file, the node's directory made new (mode 0700; an existing one is refused, even empty), every file
written through the directory's descriptor without following a link, pvegpu's guard in the node's snippets when a
container names it, then the containers started. When anything fails, what it made goes again (its processes, its
directory) and the error says so.
"""

from __future__ import annotations

from typing import Any

from pvegpu.core.errors import PvegpuError, UsageError
from pvegpu.sim.scenario import SimNode, build, named

Guard = tuple[str, str]  # pvegpu's guard: (file name, text), as the edge that installs it makes it (install.guard_text)


def _files(data: dict[str, Any], guard: Guard | None) -> dict[str, tuple[bytes, int]]:
    """pvegpu's guard in the node's snippets when a container names it (a simulated start runs it, as PVE would)."""
    if guard is not None and any(isinstance(c, dict) and c.get("hookscript") == f"local:snippets/{guard[0]}"
                                 for c in data.get("containers", []) or []):
        return {f"snippets/{guard[0]}": (guard[1].encode(), 0o755)}
    return {}


def create(directory: str | None, scenario: str | dict[str, Any], guard: Guard | None = None) -> SimNode:
    """The node of ``scenario`` (a built-in name, a JSON file, or the scenario itself), running, in the new directory
    ``directory`` (None: a temporary one its ``teardown`` removes, as ``pvegpu demo`` uses); ``guard`` is written
    into its snippets when a container names it as its hookscript."""
    data = named(scenario) if isinstance(scenario, str) else scenario
    what = f"sim create {directory}" if directory else "building the simulated node"
    try:
        return build(data, directory, _files(data, guard))
    except PvegpuError as exc:
        notes = getattr(exc, "__notes__", [])
        if notes:  # it failed after it had made something: say that it is gone again
            exc.message = f"{what} failed: {exc.message}; {'; '.join(notes)}"
            exc.args = (exc.message,)
        raise
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise UsageError(f"{what} failed: {exc.strerror or exc}{where}; "
                         f"{'; '.join(getattr(exc, '__notes__', []))}",
                         "name a new directory in one only you can write (`pvegpu sim create /tmp/my-node`)") from None


def created(sim: SimNode) -> str:
    """What ``sim create`` says: the node, its running containers, what to try next."""
    containers = [c for c in sim.scenario.get("containers", []) or [] if isinstance(c, dict)]
    running = [str(c["vmid"]) for c in containers if c.get("status", "running") == "running"]
    return (f"simulated node {sim.node} in {sim.root}: {len(containers)} container(s), running: {', '.join(running) or 'none'}\n"
            f"try: pvegpu --simulate {sim.root} audit; remove it: pvegpu sim remove {sim.root}")
