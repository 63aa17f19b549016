"""Whose simulated node this is: ``--simulate DIR`` (and ``PVEGPU_SIMULATE``) act only on a node the caller owns alone.

A simulated node's files decide what a run does: which processes are its containers' (and so get signalled),
which script its simulated start runs, which settings apply. Whoever can write them steers a run that uses the
node, so a run uses only a directory that is

- a real directory (not a symbolic link, which could be pointed elsewhere between two looks),
- owned by the user running pvegpu (root never acts on a user's node, a user never on root's),
- not writable by group or others (``sim create`` makes it 0700),
- a simulated node (its ``scenario.json`` a regular file of the same owner).

(A directory that is no node at all is told so first: that is the mistake to fix, not its mode.)

Anything else is a one-line error with a hint, exit 2, before anything is read from it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from pvegpu.adapters.safefile import read_regular
from pvegpu.core.errors import UsageError

SCENARIO = "scenario.json"
MAX_SCENARIO = 4 * 1024 * 1024


def _hint(directory: str) -> str:
    """What to run instead: ``sim create`` of that very directory only while it does not exist (``sim create`` makes
    its directory itself, and never builds into one that exists: ``/etc`` is no node)."""
    where = directory if not os.path.lexists(directory) else "/tmp/pvegpu-node"
    return (f"`pvegpu sim create {where}` builds one{'' if where == directory else ' in a new directory'} (README: Simulated node); "
            "`pvegpu demo` builds and removes one")


def check_node(directory: str, named: str = "") -> None:
    """Raise UsageError (exit 2, with a hint) unless ``directory`` is a simulated node only the caller can change.
    ``named``: how the run named it (``--simulate DIR``, ``PVEGPU_SIMULATE=DIR``), for the message."""
    named = named or f"{named}"
    me = os.geteuid()
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise UsageError(f"{named}: no such directory, so no simulated node", _hint(directory)) from None
    except OSError as exc:
        raise UsageError(f"{named}: cannot look at it ({exc.strerror or exc}): a simulated node is used by its owner",
                         "run pvegpu as the user who made it with `pvegpu sim create`") from None
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{named} is a symbolic link: a simulated node is named by its own directory",
                         f"name the directory itself: --simulate {os.path.realpath(directory)}")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{named}: not a directory, so no simulated node", _hint(directory))
    if st.st_uid != me:
        raise UsageError(f"{named} is owned by uid {st.st_uid}, not by you (uid {me}): its files decide which "
                         "processes a run signals, so a simulated node is used only by the user who made it",
                         f"run it as its owner (uid {st.st_uid}), or make your own: `pvegpu sim create DIR` (a new directory)")
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"{named}: cannot open it ({exc.strerror or exc})", _hint(directory)) from None
    try:
        try:
            sc = os.stat(SCENARIO, dir_fd=fd, follow_symlinks=False)
        except OSError:
            sc = None
    finally:
        os.close(fd)
    if sc is None or not stat.S_ISREG(sc.st_mode) or sc.st_uid != me:
        raise UsageError(f"{named}: not a simulated node (no {SCENARIO} of yours there)", _hint(directory))
    if st.st_mode & 0o022:
        raise UsageError(f"{named} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): another user "
                         "could change which processes a run signals", f"chmod 700 {directory}")


def scenario_settings(directory: str) -> dict[str, Any]:
    """The settings the node's scenario carries (``"settings": {"reset.timeout": 2}``: short waits for a demo)."""

    data = read_regular(os.path.join(directory, SCENARIO), limit=MAX_SCENARIO)
    try:
        doc = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    found = doc.get("settings") if isinstance(doc, dict) else None
    return {str(k): v for k, v in found.items()} if isinstance(found, dict) else {}


def node_settings(directory: str | None, overrides: Mapping[str, object], env: Mapping[str, str] | None = None,
                  named: str = "") -> dict[str, object]:
    """``overrides`` for a run on the simulated node ``directory`` (``--simulate`` or ``PVEGPU_SIMULATE``; none:
    returned as they are): the node checked (``check_node``), then its scenario's settings added under them. Those
    stand in for the settings file on that node; an option on the line or a ``PVEGPU_*`` variable still wins."""
    if not directory:
        return dict(overrides)
    check_node(directory, named)
    env = os.environ if env is None else env
    extra = {k: v for k, v in scenario_settings(directory).items() if "PVEGPU_" + k.replace(".", "_").upper() not in env}
    return extra | {k: v for k, v in overrides.items() if v is not None}  # None: an option not given
