"""Read a container's GPU grants from its Proxmox configuration.

Accepts the raw ``/etc/pve/nodes/<node>/lxc/<vmid>.conf`` text or the API's
``pvesh get /nodes/<node>/lxc/<vmid>/config --current 1`` dict. Only the top section describes the
running container: ``[pve:pending]`` and snapshot sections are reported as notes, never used.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .model import CtGpus
from .record import record

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from typing import Any

NVIDIA_MAJOR = 195
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
_SECTION = re.compile(r"^\[([^\]]+)\]\s*$")
_RAW = re.compile(r"^(lxc\.[a-z0-9_\-.]+)\s*(?::|=)\s*(.*?)\s*$")
_KEY = re.compile(r"^([a-z][a-z_]*\d*):\s*(.*?)\s*$")
_DEV = re.compile(r"^dev(\d+)$")
_ALLOW = re.compile(r"^c\s+(\d+|\*):(\d+|\*)\s+\S+$")


@record(frozen=True)
class CtConfig:
    """The parts of a container config pvegpu uses."""

    gpus: CtGpus
    lock: str | None = None
    tags: frozenset[str] = frozenset()
    hookscript: str | None = None
    hostname: str | None = None


def _dev_path(value: str) -> str:
    """``/dev/nvidia0,gid=44`` or ``path=/dev/nvidia0,mode=0666`` → ``/dev/nvidia0``."""
    for part in value.split(","):
        part = part.strip()
        if part.startswith("path="):
            return part[5:]
        if "=" not in part:
            return part
    return ""


def _split_sections(text: str) -> tuple[list[str], list[str]]:
    """Top-section lines, and the names of the other sections (pending, snapshots)."""
    top: list[str] = []
    sections: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if m := _SECTION.match(line):
            sections.append(m.group(1))
            continue
        if not sections:
            top.append(line)
    return top, sections


def _pairs(lines: Iterable[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        if m := _RAW.match(line):
            out.append((m.group(1), m.group(2)))
        elif m := _KEY.match(line):
            out.append((m.group(1), m.group(2)))
    return out


def _api_pairs(conf: Mapping[str, Any]) -> list[tuple[str, str]]:
    out = [(str(k), str(v)) for k, v in conf.items() if k not in ("lxc", "digest")]
    for item in conf.get("lxc") or []:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            out.append((str(item[0]), str(item[1])))
    return out


def parse_config(conf: str | Mapping[str, Any]) -> CtConfig:
    """GPU grants and metadata of one container config (text or API dict)."""
    notes: list[str] = []
    if isinstance(conf, str):
        top, sections = _split_sections(conf)
        pairs = _pairs(top)
        if "pve:pending" in sections:
            notes.append("pending changes exist; they apply at the next start and are ignored now")
        snaps = [s for s in sections if s != "pve:pending"]
        if snaps:
            notes.append(f"snapshot sections ignored: {', '.join(snaps)}")
    else:
        pairs = _api_pairs(conf)
    return _from_pairs(pairs, notes)


def _from_pairs(pairs: list[tuple[str, str]], notes: list[str]) -> CtConfig:
    minors: set[int] = set()
    sources: list[str] = []
    wildcard = False
    named_nodes = False
    lock = tags = hookscript = hostname = None
    for key, value in pairs:
        if _DEV.match(key):
            path = _dev_path(value)
            if path.startswith("/dev/nvidia"):
                named_nodes = True
            if m := _GPU_NODE.match(path):
                minors.add(int(m.group(1)))
                sources.append(f"{key}: {value}")
        elif key == "lxc.mount.entry":
            src = value.split()[0] if value.split() else ""
            if src.startswith("/dev/nvidia"):
                named_nodes = True
            if m := _GPU_NODE.match(src):
                minors.add(int(m.group(1)))
                sources.append(f"{key}: {value}")
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            m = _ALLOW.match(value)
            if m and m.group(1) == str(NVIDIA_MAJOR):
                if m.group(2) == "*":
                    wildcard = True
                    sources.append(f"{key}: {value}")
                elif int(m.group(2)) < 254:
                    minors.add(int(m.group(2)))
                    sources.append(f"{key}: {value}")
            if key == "lxc.cgroup.devices.allow":
                notes.append("uses deprecated cgroup v1 key lxc.cgroup.devices.allow")
        elif key == "lock":
            lock = value
        elif key == "tags":
            tags = value
        elif key == "hookscript":
            hookscript = value
        elif key == "hostname":
            hostname = value
    all_gpus = wildcard and not named_nodes
    if lock:
        notes.append(f"config is locked ({lock})")
    tagset = frozenset(t for t in re.split(r"[;,\s]+", tags or "") if t)
    gpus = CtGpus(frozenset(minors), all_gpus, tuple(sources), tuple(dict.fromkeys(notes)))
    return CtConfig(gpus=gpus, lock=lock, tags=tagset, hookscript=hookscript, hostname=hostname)
