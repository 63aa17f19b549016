"""The record of NVML-listed pids that lasts between pvegpu's runs: ``<gate.record_dir>/seen.json``.

NVML names a context's owner by pid only, and the kernel hands a freed pid out again: what tells a later process at
that number (or a session made there) from the owner is what an earlier run saw of it. Each gate run (pre-start,
post-stop, check) and each audit writes, per pid NVML lists now, the start time and placement of its process when
last seen alive and listed, and when it was first seen listed but dead (``core.model.SeenPid``); pids no longer
listed are dropped, so the file stays as small as NVML's lists. Manual equivalent: ``cat /run/pvegpu/pids/seen.json``.

The directory is checked as the reset lock directory is (``locks.open_dir``: this user's, mode 0700, in a parent
nobody else may write); the file is read only when it is a regular file of this user, open to nobody else, of at most
1 MiB, and of this boot (``/proc/sys/kernel/random/boot_id``: start times count from boot). Anything
else is ignored, never trusted: no record, as on a node's first run after boot. It is written with the one atomic
writer (``safefile.write_atomic``), mode 600; a record that cannot be written is no error (the gate never fails on it).
"""

from __future__ import annotations

import json
import os
import stat

from pvegpu.adapters import locks
from pvegpu.adapters.safefile import open_nofollow, write_atomic
from pvegpu.core.errors import UsageError
from pvegpu.core.model import Place, Placement, SeenPid

NAME = "seen.json"
MAX_PIDS = 4096  # more listed pids than any node's GPUs hold contexts: a record past it keeps the first ones
MAX_BYTES = 1 << 20


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _dir(record_dir: str, create: bool) -> int | None:
    try:
        return locks.open_dir(record_dir, create=create, what="pid record directory", setting="gate.record_dir")
    except (OSError, UsageError):
        return None


def read(record_dir: str, boot: str | None = None) -> dict[int, SeenPid] | None:
    """The record, or None when absent, of another boot, or not to be trusted (see the module)."""
    dfd = _dir(record_dir, create=False)
    if dfd is None:
        return None
    try:
        fd = open_nofollow(NAME, dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > MAX_BYTES:
            return None
        data = json.loads(os.read(fd, MAX_BYTES + 1))
        if data.get("boot") != (boot_id() if boot is None else boot):
            return None
        return {int(pid): _entry(e) for pid, e in list(data["pids"].items())[:MAX_PIDS]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    finally:
        os.close(fd)


def write(record_dir: str, record: dict[int, SeenPid], boot: str | None = None) -> None:
    """Replace the record (at most ``MAX_PIDS`` pids); best effort."""
    dfd = _dir(record_dir, create=True)
    if dfd is None:
        return
    pids = {str(pid): _json(e) for pid, e in sorted(record.items())[:MAX_PIDS]}
    try:
        data = json.dumps({"boot": boot_id() if boot is None else boot, "pids": pids}, sort_keys=True).encode()
        write_atomic(NAME, data, mode=0o600, dir_fd=dfd, fsync=False)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _json(e: SeenPid) -> dict[str, object]:
    where = None if e.placement is None else {"place": str(e.placement.place), "vmid": e.placement.vmid}
    return {"start": e.start_ticks, "where": where, "dead_since": e.dead_since}


def _entry(d: dict[str, object]) -> SeenPid:
    where = d["where"]
    place = None if where is None else Placement(Place(str(where["place"])), _int(where["vmid"]))  # type: ignore[index]
    return SeenPid(_int(d["start"]), place, _int(d["dead_since"]))


def _int(v: object) -> int | None:
    if v is None:
        return None
    if type(v) is not int:
        raise TypeError("not an integer")
    return v
