"""Map ``/proc/<pid>/cgroup`` to a Proxmox guest, by the prefix the host created.

PVE (lxc >= 4) puts container payload under ``/lxc/<vmid>/ns/...`` and the lxc-start monitor
under ``/lxc.monitor/<vmid>``; QEMU guests run in ``/qemu.slice/<vmid>.scope``. On cgroup v1 or
hybrid hosts there is one line per hierarchy; all of them must agree.

Tenant-proof rules (``cat /proc/<pid>/cgroup`` by hand shows the same lines):

- Lines are split on ``\\n`` only. The kernel refuses ``\\n`` in cgroup names but allows ``\\r``,
  ``\\v``, ``\\f``, ``\\x1c``-``\\x1e`` and U+0085, which ``str.splitlines`` would also break on: a tenant
  could then forge a second line such as ``0::/lxc.monitor/730`` inside its own cgroup's name.
- Only the *leading* components decide: ``/lxc/<vmid>/`` was made by the host, and everything the
  tenant can create lies below it, so a nested cgroup named ``lxc.monitor`` or ``730`` changes nothing.
- A file that cannot be read, or whose hierarchies disagree, is ``Place.UNKNOWN``: never the host.
"""

from __future__ import annotations

from pvegpu.core.model import Place, Placement

HOST = Placement(Place.HOST)
UNKNOWN = Placement(Place.UNKNOWN)


def _vmid(path: str, prefix: str, suffix: str = "") -> int | None:
    r"""The vmid of ``path`` when its leading components are ``<prefix><digits><suffix>`` (then ``/`` or the end):
    ``re.match(prefix + r"(\d+)" + suffix + r"(?:/|\Z)", path)``, matched by hand. ``\d`` is any Unicode decimal
    digit, as ``str.isdecimal`` and ``int`` take them."""
    if not path.startswith(prefix):
        return None
    end = path.find("/", len(prefix))
    part = path[len(prefix):] if end < 0 else path[len(prefix):end]
    if suffix:
        if not part.endswith(suffix):
            return None
        part = part[: -len(suffix)]
    return int(part) if part.isdecimal() else None  # "".isdecimal() is False: one digit at least


def placement_of_path(path: str) -> Placement:
    """Classify one cgroup path (the third field of a ``/proc/<pid>/cgroup`` line) by its leading components:
    ``/lxc.monitor/<vmid>``, ``/lxc/<vmid>``, ``/qemu.slice/<vmid>.scope``, each followed by ``/`` or the end."""
    if (vmid := _vmid(path, "/lxc.monitor/")) is not None:
        return Placement(Place.MONITOR, vmid)
    if (vmid := _vmid(path, "/lxc/")) is not None:
        return Placement(Place.CONTAINER, vmid)
    if (vmid := _vmid(path, "/qemu.slice/", ".scope")) is not None:
        return Placement(Place.VM, vmid)
    return HOST


def parse_cgroup(text: str | bytes) -> tuple[Placement, str]:
    """Placement of a process from its whole ``/proc/<pid>/cgroup`` file, and the raw path that decided it.

    A guest placement on any hierarchy wins over "host" (hybrid hosts leave some controllers at /);
    guest placements that disagree make it UNKNOWN; an empty or malformed file is UNKNOWN too.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    found: list[tuple[Placement, str]] = []
    lines = 0
    for line in text.split("\n"):  # never splitlines(): see the module docstring
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        lines += 1
        if parts[2] == "/":  # a hierarchy left at the root (hybrid hosts): the host's, what placement_of_path says
            continue
        place = placement_of_path(parts[2])
        if place.place is not Place.HOST:
            found.append((place, parts[2]))
    if not lines:
        return UNKNOWN, "?"
    if not found:
        return HOST, "/"
    if len({p for p, _ in found}) > 1:
        return UNKNOWN, found[0][1]
    return found[0]
