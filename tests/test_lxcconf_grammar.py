"""The hand matchers of the config and cgroup grammar are exactly the regular expressions they replace (issue 20)."""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pvegpu.core import cgroup, lxcconf

# -- the patterns of release 19, the reference ------------------------------------------------------------------

GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
SECTION = re.compile(r"^\[([^\]]+)\]\s*$")
RAW = re.compile(r"^(lxc\.[a-z0-9_\-.]+)\s*(?::|=)\s*(.*?)\s*$")
KEY = re.compile(r"^([a-z][a-z_]*\d*):\s*(.*?)\s*$")
DEV = re.compile(r"^dev(\d+)$")
ALLOW = re.compile(r"^c\s+(\d+|\*):(\d+|\*)\s+\S+$")
PAIR = re.compile(r"^([a-z][a-z0-9_.\-]*)\s*[:=]\s*(.*?)\s*$")  # audit_guests' of release 19
CT = re.compile(r"/lxc/(\d+)(?:/|\Z)")
MONITOR = re.compile(r"/lxc\.monitor/(\d+)(?:/|\Z)")
VM = re.compile(r"/qemu\.slice/(\d+)\.scope(?:/|\Z)")

# characters where a hand matcher could differ from re: Unicode digits and spaces, line ends, the grammar's marks
ODD = "0 1 9 a z A _ - . : = * [ ] / c d e v l x n i s o p q u \t \n \r \x0b \x0c \x1c \x85 \xa0 \u2028 \u3000 ٣ ७ ¹ ½ é"
PIECES = ["lxc.", "dev", "/dev/nvidia", "c ", "195", ":", "rwm", "lxc.cgroup2.devices.allow", "/lxc/", "/lxc.monitor/",
          "/qemu.slice/", ".scope", "129", "[", "]", "pve:pending", " = ", ": "] + ODD.split(" ") + [" "]
TEXT = st.lists(st.sampled_from(PIECES), max_size=10).map("".join)


def group(m: re.Match[str] | None, *n: int) -> object:
    return None if m is None else (m.group(*n) if len(n) > 1 else m.group(n[0]))


def test_the_patterns_classes_are_what_the_matchers_use():
    """``\\s`` is ``str.isspace`` and ``\\d`` is ``str.isdecimal`` on every code point (the matchers rely on it)."""
    space, digit = re.compile(r"\s"), re.compile(r"\d")
    for code in range(sys.maxunicode + 1):
        ch = chr(code)
        assert bool(space.match(ch)) == ch.isspace(), hex(code)
        assert bool(digit.match(ch)) == ch.isdecimal(), hex(code)


@settings(max_examples=400)
@given(TEXT)
def test_the_config_matchers_are_the_patterns_of_release_19(text):
    """Each line matcher of ``lxcconf`` gives what ``re.match`` of its pattern gives."""
    assert lxcconf._gpu_node(text) == (None if (m := GPU_NODE.match(text)) is None else int(m.group(1)))
    assert lxcconf._section(text) == group(SECTION.match(text), 1)
    assert lxcconf._raw(text) == group(RAW.match(text), 1, 2)
    assert lxcconf._key(text) == group(KEY.match(text), 1, 2)
    assert lxcconf.dev_key(text) == bool(DEV.match(text))
    assert lxcconf._allow(text) == group(ALLOW.match(text), 1, 2)
    assert lxcconf.any_pair(text) == group(PAIR.match(text), 1, 2)


@settings(max_examples=300)
@given(TEXT)
def test_the_tags_split_is_the_pattern_of_release_19(text):
    r"""A config's tags split as ``re.split(r"[;,\s]+")`` less the empty pieces split them (the API's form: any text)."""
    assert lxcconf.parse_config({"tags": text}).tags == frozenset(t for t in re.split(r"[;,\s]+", text) if t)


@settings(max_examples=400)
@given(TEXT)
def test_the_cgroup_matchers_are_the_patterns_of_release_19(text):
    """A cgroup path's placement is what the three patterns of release 19 make of it."""
    if m := MONITOR.match(text):
        want = (cgroup.Place.MONITOR, int(m.group(1)))
    elif m := CT.match(text):
        want = (cgroup.Place.CONTAINER, int(m.group(1)))
    elif m := VM.match(text):
        want = (cgroup.Place.VM, int(m.group(1)))
    else:
        want = (cgroup.Place.HOST, None)
    got = cgroup.placement_of_path(text)
    assert (got.place, got.vmid) == want


@pytest.mark.parametrize("line, want", [
    ("dev0: /dev/nvidia0,gid=44", ("dev0", "/dev/nvidia0,gid=44")),
    ("lxc.cgroup2.devices.allow: c 195:* rwm", ("lxc.cgroup2.devices.allow", "c 195:* rwm")),
    ("lxc.mount.entry = /dev/nvidia1 dev/nvidia1 none bind,optional,create=file", ("lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind,optional,create=file")),
    ("dev1 : /dev/nvidia1", None),
    ("Dev0: /dev/nvidia0", None),
])
def test_config_lines_as_pve_writes_them(line, want):
    """The lines PVE and admins write parse to their key and value; near misses parse to nothing."""
    assert (lxcconf._raw(line) or lxcconf._key(line)) == want
