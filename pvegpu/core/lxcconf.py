"""Read a container's GPU grants from its Proxmox configuration.

Accepts the raw ``/etc/pve/nodes/<node>/lxc/<vmid>.conf`` text or the API's
``pvesh get /nodes/<node>/lxc/<vmid>/config --current 1`` dict. Only the top section describes the
running container: ``[pve:pending]`` and snapshot sections are reported as notes, never used.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pvegpu.core.model import CtGpus

NVIDIA_MAJOR = 195

# The line grammar, matched by hand. Each matcher is
# exactly ``re.match`` of the pattern in its docstring: ``\d`` is a Unicode decimal digit (``str.isdecimal``), ``\s``
# Unicode whitespace (``str.isspace``, ``strip``, ``split``), ``$`` the end or before a last ``\n``, ``.`` anything but
# ``\n``. ``tests/test_lxcconf_grammar.py`` runs each matcher against its pattern.
_LOWER = frozenset("abcdefghijklmnopqrstuvwxyz")
_RAW_KEY = _LOWER | frozenset("0123456789_-.")


def _end(text: str) -> str:
    r"""``text`` less one final ``\n``: where ``$`` also matches."""
    return text[:-1] if text.endswith("\n") else text


def _digits(text: str) -> str | None:
    r"""``text`` when it is ``\d+$``."""
    text = _end(text)
    return text if text.isdecimal() else None


def _gpu_node(path: str) -> int | None:
    r"""``^/dev/nvidia(\d+)$``: the minor."""
    digits = _digits(path[11:]) if path.startswith("/dev/nvidia") else None
    return None if digits is None else int(digits)


def _section(line: str) -> str | None:
    r"""``^\[([^\]]+)\]\s*$``: the section's name."""
    end = line.find("]", 1)
    if not line.startswith("[") or end < 2:
        return None
    tail = line[end + 1:]
    return line[1:end] if not tail or tail.isspace() else None


def _value(rest: str) -> str | None:
    r"""``\s*(.*?)\s*$`` over ``rest``: the value, without its surrounding whitespace."""
    value = rest.strip()
    return None if "\n" in value else value


def _key_then_value(line: str, start: int) -> tuple[str, str] | None:
    r"""The key ``line[:start]`` runs on over ``[a-z0-9_\-.]*``, then ``\s*(?::|=)\s*(.*?)\s*$``: (key, value)."""
    end = start
    while end < len(line) and line[end] in _RAW_KEY:
        end += 1
    rest = line[end:].lstrip()
    if not rest or rest[0] not in ":=":
        return None
    value = _value(rest[1:])
    return None if value is None else (line[:end], value)


def _raw(line: str) -> tuple[str, str] | None:
    r"""``^(lxc\.[a-z0-9_\-.]+)\s*(?::|=)\s*(.*?)\s*$``: a raw ``lxc.*`` key and its value."""
    if not line.startswith("lxc.") or len(line) < 5 or line[4] not in _RAW_KEY:
        return None
    return _key_then_value(line, 5)


def any_pair(line: str) -> tuple[str, str] | None:
    r"""``^([a-z][a-z0-9_.\-]*)\s*[:=]\s*(.*?)\s*$``: any key (PVE's or a raw ``lxc.*``) and its value
    (``audit_guests``: the device paths a start needs)."""
    if not line or line[0] not in _LOWER:
        return None
    return _key_then_value(line, 1)


def dev_key(key: str) -> bool:
    r"""``^dev(\d+)$``: a ``devN`` passthrough key."""
    return key.startswith("dev") and _digits(key[3:]) is not None


def _key(line: str) -> tuple[str, str] | None:
    r"""``^([a-z][a-z_]*\d*):\s*(.*?)\s*$``: a PVE key and its value."""
    colon = line.find(":")
    key = line[:colon]
    if colon < 1 or key[0] not in _LOWER:
        return None
    end = 1
    while end < len(key) and (key[end] in _LOWER or key[end] == "_"):
        end += 1
    if end < len(key) and not key[end:].isdecimal():
        return None
    value = _value(line[colon + 1:])
    return None if value is None else (key, value)




def _allow(value: str) -> tuple[str, str] | None:
    r"""``^c\s+(\d+|\*):(\d+|\*)\s+\S+$``: a device rule's major and minor (digits or ``*``)."""
    text = _end(value)
    rest = text[1:].lstrip()
    if not text.startswith("c") or len(rest) == len(text) - 1:
        return None
    colon = rest.find(":")
    major = rest[:colon]
    if colon < 1 or not (major == "*" or major.isdecimal()):
        return None
    end = colon + 1
    if rest.startswith("*", end):
        end += 1
    else:
        while end < len(rest) and rest[end].isdecimal():
            end += 1
    minor, tail = rest[colon + 1:end], rest[end:]
    mode = tail.lstrip()
    if not minor or len(mode) == len(tail) or not mode or mode.split() != [mode]:
        return None
    return major, minor


@dataclass(frozen=True)
class CtConfig:
    """The parts of a container config pvegpu uses."""

    gpus: CtGpus
    lock: str | None = None
    tags: frozenset[str] = frozenset()
    hookscript: str | None = None
    hostname: str | None = None
    entrypoint: tuple[str, ...] | None = None  # the command LXC runs as the container's PID 1, when the config names one

    @property
    def app(self) -> bool:
        """An application container (PVE 9.1 OCI): its PID 1 is the workload, not a system init."""
        return self.entrypoint is not None and self.entrypoint[0] not in SYSTEM_INITS


# PID 1 commands that are a system init (PVE's default entrypoint is /sbin/init, pve-container src/PVE/LXC/Config.pm);
# any other command is the workload itself (an OCI image's Entrypoint+Cmd, src/PVE/LXC/Create.pm).
SYSTEM_INITS = frozenset({"/sbin/init", "/usr/sbin/init", "/bin/init", "/usr/bin/init", "/lib/systemd/systemd",
                          "/usr/lib/systemd/systemd"})
# Where a config names PID 1's command: PVE 9.1's ``entrypoint`` (written as ``lxc.init.cmd``), then raw keys, which
# pve-container appends after it (src/PVE/LXC.pm), so the last raw one is what LXC runs; ``lxc.init_cmd`` is LXC's old name.
INIT_KEYS = ("entrypoint", "lxc.init.cmd", "lxc.init_cmd")


def _init_cmd(value: str) -> tuple[str, ...] | None:
    """PID 1's argv from an entrypoint value (shell-quoted, as pve-container writes it: ``PVE::Tools::cmd2string``);
    None when it cannot be split into a command (an open quote, nothing)."""
    try:
        argv = shlex.split(value)
    except ValueError:
        return None
    return tuple(argv) or None


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
        if (name := _section(line)) is not None:
            sections.append(name)
            continue
        if not sections:
            top.append(line)
    return top, sections


def _pairs(lines: Iterable[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        if (pair := _raw(line) or _key(line)) is not None:
            out.append(pair)
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
    init: str | None = None
    init_key = ""
    for key, value in pairs:
        if dev_key(key):
            path = _dev_path(value)
            if path.startswith("/dev/nvidia"):
                named_nodes = True
            if (minor := _gpu_node(path)) is not None:
                minors.add(minor)
                sources.append(f"{key}: {value}")
        elif key == "lxc.mount.entry":
            src = value.split()[0] if value.split() else ""
            if src.startswith("/dev/nvidia"):
                named_nodes = True
            if (minor := _gpu_node(src)) is not None:
                minors.add(minor)
                sources.append(f"{key}: {value}")
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            rule = _allow(value)
            if rule and rule[0] == str(NVIDIA_MAJOR):
                if rule[1] == "*":
                    wildcard = True
                    sources.append(f"{key}: {value}")
                elif int(rule[1]) < 254:
                    minors.add(int(rule[1]))
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
        elif key in INIT_KEYS and (key != "entrypoint" or not init_key.startswith("lxc.")):
            init, init_key = value, key
    all_gpus = wildcard and not named_nodes
    if lock:
        notes.append(f"config is locked ({lock})")
    tagset = frozenset((tags or "").replace(";", " ").replace(",", " ").split())  # re.split(r"[;,\s]+"), no empties
    entrypoint = None if init is None else _init_cmd(init)
    if init is not None and entrypoint is None:
        notes.append(f"{init_key} cannot be parsed as a command; treated as a plain container (system init)")
    gpus = CtGpus(frozenset(minors), all_gpus, tuple(sources), tuple(dict.fromkeys(notes)))
    return CtConfig(gpus=gpus, lock=lock, tags=tagset, hookscript=hookscript, hostname=hostname, entrypoint=entrypoint)
