"""What HA would do with a GPU container whose start the gate refuses, from ``/etc/pve/ha/*.cfg`` (pure).

When the start gate refuses an HA resource's start, the LRM retries it on the node ``max_restart`` times (default
1), then the CRM relocates it to another node while its failed nodes are at most ``max_relocate`` (default 1), then
leaves it in ``error`` until ``ha-manager set ct:N --state disabled`` (pve-ha-manager ``src/PVE/HA/Manager.pm``,
``src/PVE/HA/Resources.pm``). A container's ``devN: /dev/nvidiaN`` is node-local: on another node it is another card,
or none. So a GPU container under HA wants ``max_relocate 0`` and a placement restricted to its node: a strict
node-affinity rule (PVE 9, ``rules.cfg``) or a restricted group (PVE 8, ``groups.cfg``).

The three files are PVE's section config (``ct: 129`` then tab-indented ``key value`` lines). ``judge`` takes their
text (None: the file is absent, so nothing of that kind is configured) or why they could not be read; a file it
needs that cannot be read or parsed makes the answer "HA state unknown", never a guess.

Manual equivalent: ``ha-manager config``, ``ha-manager groupconfig``, ``ha-manager rules config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FILES = ("resources.cfg", "groups.cfg", "rules.cfg")  # under /etc/pve/ha/
DEFAULT_MAX_RELOCATE = 1  # pve-ha-manager src/PVE/HA/Resources.pm
IGNORED = "ignored"  # a resource state in which HA neither starts, recovers nor relocates it: a start is a plain start


class HaParseError(ValueError):
    """A line of an HA file that is no section header, no property and no comment."""


Section = tuple[str, str, dict[str, str]]  # (type, id, properties)


def sections(text: str) -> list[Section]:
    """The sections of a section-config file: ``type: id`` then indented ``key value`` lines (a key alone is
    ``key 1``, as PVE's flags) up to an empty line, where PVE's ``SectionConfig`` ends a section (a property after it
    is ignored there, so it is never read here as the section's); raises HaParseError on anything else."""
    out: list[Section] = []
    open_section = False
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not raw:
            open_section = False
            continue
        if not line or line.startswith("#"):
            continue
        if raw[0] not in " \t":
            kind, colon, ident = line.partition(":")
            if not colon or not kind or not ident.strip() or " " in kind:
                raise HaParseError(f"line {n}: not a section header (type: id)")
            out.append((kind, ident.strip(), {}))
            open_section = True
            continue
        if not open_section:
            raise HaParseError(f"line {n}: a property outside any section (before the first, or after an empty line)")
        key, _, value = line.partition(" ")
        out[-1][2][key] = value.strip() or "1"
    return out


def _nodes(value: str) -> frozenset[str]:
    """``node1:2,node2`` → {node1, node2} (priorities dropped)."""
    return frozenset(p.split(":", 1)[0].strip() for p in value.split(",") if p.strip())


@dataclass(frozen=True)
class HaFiles:
    """The HA files as read: text (None: absent) or, in ``unreadable``, why one could not be read."""

    texts: dict[str, str | None] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HaVerdict:
    """One container under HA: managed (None: unknown), what a refused start would do, and the settings to use."""

    vmid: int
    managed: bool | None
    state: str | None = None
    max_relocate: int | None = None
    pinned: bool | None = None  # a strict node-affinity rule or a restricted group with only this node
    problems: tuple[str, ...] = ()
    fix: tuple[str, ...] = ()
    unknown: str | None = None  # why the HA state is unknown

    @property
    def sid(self) -> str:
        return f"ct:{self.vmid}"

    @property
    def flagged(self) -> bool:
        """Needs the admin: a refused start would move it or leave it in ``error``, or HA state is unknown."""
        return bool(self.problems) or self.managed is None

    def to_json(self) -> dict[str, object]:
        return {"vmid": self.vmid, "sid": self.sid, "managed": self.managed, "state": self.state,
                "max_relocate": self.max_relocate, "pinned": self.pinned, "problems": list(self.problems),
                "fix": list(self.fix), "unknown": self.unknown}

    def line(self) -> str:
        """The verdict for a person, one line."""
        if self.managed is None:
            return f"CT {self.vmid}: HA state unknown ({self.unknown}): whether HA moves it after a refused start cannot be told"
        return f"CT {self.vmid} is HA-managed ({self.sid}): " + "; ".join(self.problems) + ". Fix: " + "; ".join(self.fix)


def _parsed(files: HaFiles, name: str) -> list[Section] | str:
    """The sections of ``name`` ([] when absent), or why they cannot be had."""
    if name in files.unreadable:
        return f"/etc/pve/ha/{name} cannot be read: {files.unreadable[name]}"
    text = files.texts.get(name)
    try:
        return sections(text) if text is not None else []
    except HaParseError as exc:
        return f"/etc/pve/ha/{name} cannot be parsed ({exc})"


def judge(vmid: int, node: str, files: HaFiles) -> HaVerdict:
    """What HA does with CT ``vmid`` on ``node`` after a refused start, from the HA files."""
    sid = f"ct:{vmid}"
    resources = _parsed(files, "resources.cfg")
    if isinstance(resources, str):
        return HaVerdict(vmid, None, unknown=resources)
    mine = next((p for kind, ident, p in resources if f"{kind}:{ident}" == sid), None)
    if mine is None:
        return HaVerdict(vmid, False)
    if mine.get("state") == IGNORED:
        return HaVerdict(vmid, False, IGNORED)
    try:
        relocate = int(mine.get("max_relocate", DEFAULT_MAX_RELOCATE))
    except ValueError:
        return HaVerdict(vmid, None, unknown=f"max_relocate of {sid} is not a number ({mine['max_relocate']!r})")
    pinned = False
    group = mine.get("group")
    if group:
        groups = _parsed(files, "groups.cfg")
        if isinstance(groups, str):
            return HaVerdict(vmid, None, unknown=groups)
        g = next((p for kind, ident, p in groups if kind == "group" and ident == group), None)
        pinned = g is not None and g.get("restricted") == "1" and _nodes(g.get("nodes", "")) == {node}
    rules = _parsed(files, "rules.cfg")
    if isinstance(rules, str):
        return HaVerdict(vmid, None, unknown=rules)
    for kind, _ident, p in rules:
        if kind == "node-affinity" and "disable" not in p and p.get("strict") == "1" and sid in _sids(p.get("resources", "")):
            pinned = pinned or _nodes(p.get("nodes", "")) == {node}
    problems: list[str] = []
    fix: list[str] = []
    if relocate > 0:
        problems.append(f"max_relocate {relocate}: a start the gate refuses is retried, then relocated to another node "
                        "(where /dev/nvidiaN is another card or none), then left in 'error'")
        fix.append(f"ha-manager set {sid} --max_relocate 0")
    if not pinned:
        problems.append(f"no strict node-affinity rule (or restricted group) keeps it on {node}: HA may start it on a node without its GPU")
        fix.append(f"PVE 9: ha-manager rules add node-affinity gpu-ct{vmid} --resources {sid} --nodes {node} --strict 1")
        fix.append(f"PVE 8: ha-manager groupadd gpu-{node} --nodes {node} --restricted 1 && ha-manager set {sid} --group gpu-{node}")
    return HaVerdict(vmid, True, mine.get("state", "started"), relocate, pinned, tuple(problems), tuple(fix))


def _sids(value: str) -> frozenset[str]:
    return frozenset(s.strip() for s in value.split(",") if s.strip())


def managed(sid: str, files: HaFiles) -> bool | None:
    """Is ``sid`` (``ct:129``, ``vm:200``) an HA resource (None: resources.cfg cannot be read or parsed)? For the
    start gate's refusal line."""
    resources = _parsed(files, "resources.cfg")
    if isinstance(resources, str):
        return None
    return any(f"{kind}:{ident}" == sid and p.get("state") != IGNORED for kind, ident, p in resources)
