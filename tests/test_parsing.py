"""Parsing of PVE container configs, /proc/<pid>/cgroup lines (proxmox.md §2, §4) and /proc/<pid>/stat (a ``Stat``
that copies, pickles and unpacks as a named tuple)."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pvegpu.adapters.procstat import Stat, parse_stat
from pvegpu.core.cgroup import parse_cgroup
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import Place, Placement

A = """#LLM worker (GPU0)
arch: amd64
dev0: /dev/nvidia0,gid=44
dev1: /dev/nvidiactl,gid=44
dev2: /dev/nvidia-uvm,gid=44
dev4: /dev/nvidia-caps/nvidia-cap1,mode=0444
hookscript: local:snippets/pvegpu-guard
tags: gpu;gpu-exclusive
"""
B = """arch: amd64
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.cgroup2.devices.allow: c 510:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file
lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
"""
C = """lxc.cgroup.devices.allow: c 195:* rwm
lxc.mount.entry: /dev/nvidia2 dev/nvidia2 none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir
"""
D = """arch: amd64
dev0: /dev/nvidia3
lock: backup
parent: before_upgrade

[pve:pending]
delete: dev0

[before_upgrade]
dev0: /dev/nvidia3
dev1: /dev/nvidia5
snaptime: 1717000000
"""


def test_devn_with_options():
    """devN entries with gid/mode options grant /dev/nvidiaN only; ctl/uvm/caps are not GPUs."""
    c = parse_config(A)
    assert c.gpus.minors == {0} and not c.gpus.all_gpus
    assert c.hookscript == "local:snippets/pvegpu-guard" and "gpu-exclusive" in c.tags


def test_path_key_form():
    """dev0: path=/dev/nvidia1,mode=0666 is the same grant as the short form."""
    assert parse_config("dev0: path=/dev/nvidia1,mode=0666\n").gpus.minors == {1}


def test_raw_cgroup2_with_mount_entries_uses_mount_sources():
    """195:* plus named mount entries grants exactly the mounted GPUs, not all of them."""
    c = parse_config(B)
    assert c.gpus.minors == {0, 1} and not c.gpus.all_gpus


def test_cgroup_v1_legacy_noted():
    """The deprecated v1 key still grants, and is reported."""
    c = parse_config(C)
    assert c.gpus.minors == {2}
    assert any("deprecated" in n for n in c.gpus.notes)


def test_wildcard_without_nodes_means_all_gpus():
    """Major 195 granted with no node named means every GPU."""
    assert parse_config("lxc.cgroup2.devices.allow: c 195:* rwm\n").gpus.all_gpus


def test_specific_minor_in_cgroup_rule():
    """c 195:3 rw grants GPU minor 3; 195:255 (nvidiactl) grants no GPU."""
    assert parse_config("lxc.cgroup2.devices.allow: c 195:3 rw\nlxc.cgroup2.devices.allow = c 195:255 rw\n").gpus.minors == {3}


def test_pending_and_snapshots_reported_not_used():
    """Only the top section counts; pending and snapshot sections become notes; lock is read."""
    c = parse_config(D)
    assert c.gpus.minors == {3} and c.lock == "backup"
    notes = " ".join(c.gpus.notes)
    assert "pending" in notes and "before_upgrade" in notes and "locked (backup)" in notes


def test_api_dict_form():
    """The API's config dict (raw keys as [key, value] pairs) parses like the file."""
    c = parse_config({"dev0": "/dev/nvidia0,gid=44", "lxc": [["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind"]], "digest": "x"})
    assert c.gpus.minors == {0, 1}


def test_no_gpu():
    """A container without NVIDIA nodes has no grant."""
    c = parse_config("arch: amd64\ndev0: /dev/dri/renderD128,gid=104\n")
    assert not c.gpus.minors and not c.gpus.all_gpus


def test_cgroup_v2_payload_and_init():
    """v2 lines under /lxc/<vmid>/ns place the process in that container."""
    assert parse_cgroup("0::/lxc/129/ns/system.slice/ollama.service\n")[0] == Placement(Place.CONTAINER, 129)
    assert parse_cgroup("0::/lxc/129/ns\n")[0] == Placement(Place.CONTAINER, 129)


def test_cgroup_monitor_is_not_the_container():
    """The lxc-start monitor under /lxc.monitor/<vmid> is never the container."""
    assert parse_cgroup("0::/lxc.monitor/129\n")[0].place is Place.MONITOR


def test_cgroup_v1_and_hybrid():
    """v1 and hybrid files (one line per hierarchy, some at /) place by the lxc lines."""
    text = "12:devices:/lxc/129/ns/x\n4:memory:/lxc/129/ns\n1:name=systemd:/\n0::/lxc/129/ns\n"
    assert parse_cgroup(text)[0] == Placement(Place.CONTAINER, 129)


def test_cgroup_qemu_scope_and_host():
    """QEMU scopes are VMs; anything else is the host."""
    assert parse_cgroup("0::/qemu.slice/200.scope\n")[0] == Placement(Place.VM, 200)
    assert parse_cgroup("0::/system.slice/pvedaemon.service\n")[0].place is Place.HOST
    assert parse_cgroup("0::/lxc/1290\n")[0] == Placement(Place.CONTAINER, 1290)
    assert parse_cgroup("0::/lxcfoo/129\n")[0].place is Place.HOST


def test_cgroup_conflicting_vmids_is_unknown():
    """Lines that disagree about the container make the placement unknown: untouchable, and never "host"."""
    assert parse_cgroup("4:memory:/lxc/129/ns\n0::/lxc/130/ns\n")[0].place is Place.UNKNOWN
    assert parse_cgroup("")[0].place is Place.UNKNOWN


@pytest.mark.parametrize("brk", ["\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\u0085", "\u2028"])
def test_cgroup_name_with_line_breaks_cannot_forge_a_line(brk):
    """Only \\n ends a line: a tenant cgroup named 'x<brk>0::/lxc.monitor/730' or 'x<brk>0::/' stays in its CT."""
    for tail in ("0::/lxc.monitor/730", "0::/", "0::/lxc/731/ns"):
        placement, path = parse_cgroup(f"0::/lxc/129/ns/x{brk}{tail}\n")
        assert placement == Placement(Place.CONTAINER, 129) and path.endswith(tail)
    assert parse_cgroup(f"0::/lxc/129/ns/x{brk}\n".encode())[0] == Placement(Place.CONTAINER, 129)


def test_cgroup_placement_by_leading_components_only():
    """A nested cgroup named like another guest deep in a tenant's tree does not move the process."""
    assert parse_cgroup("0::/lxc/129/ns/lxc/130/ns\n")[0] == Placement(Place.CONTAINER, 129)
    assert parse_cgroup("0::/lxc/129/ns/lxc.monitor/130\n")[0] == Placement(Place.CONTAINER, 129)
    assert parse_cgroup("0::/system.slice/x/lxc/129/ns\n")[0].place is Place.HOST


def test_stat_reader_handles_hostile_comm():
    """comm with spaces, ')' and a newline does not shift the fields of /proc/<pid>/stat."""
    from pvegpu.adapters.procstat import parse_stat

    tail = b"S 7 8 9 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 3 0 12345 1 2 3"
    st = parse_stat(b"42 (a) S 1 (b\n c) " + tail)
    assert st is not None and st.comm == b"a) S 1 (b\n c" and (st.state, st.ppid, st.sid) == ("S", 7, 9)
    assert (st.threads, st.start_ticks) == (3, 12345)
    assert parse_stat(b"42 (x) S 1") is None and parse_stat(b"garbage") is None


STAT_LINE = b"42 (a b) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 3 0 12345 0 0\n"


def test_stat_copies_and_pickles_as_the_namedtuple_did():
    """``Stat`` copies, deep-copies and pickles to an equal Stat."""
    st = parse_stat(STAT_LINE)
    assert st is not None and st.threads == 3 and st.start_ticks == 12345
    assert copy.copy(st) == st and copy.deepcopy(st) == st
    assert pickle.loads(pickle.dumps(st)) == st and type(pickle.loads(pickle.dumps(st))) is Stat


def test_stat_keeps_the_namedtuple_helpers():
    """``Stat`` has a named tuple's ``_replace``, ``_asdict``, ``_make`` and ``__match_args__``."""
    st = parse_stat(STAT_LINE)
    assert st is not None
    assert st._replace(ppid=7).ppid == 7
    assert st._asdict()["comm"] == b"a b"
    assert Stat._make(tuple(st)) == st
    assert Stat.__match_args__ == Stat._fields

def test_escape_makes_tenant_text_printable():
    """Control and non-printable characters (and bad UTF-8) come out as \\xNN / \\uNNNN; backslash doubled."""
    from pvegpu.core.safetext import escape

    assert escape("a\x1b[2J\r\n\t\\b") == "a\\x1b[2J\\x0d\\x0a\\x09\\\\b"
    assert escape("\u202eevil\u0085\U000e0041") == "\\u202eevil\\x85\\U000e0041"
    assert escape(b"ok\xff\xc3\xa9") == "ok\\xffé"
    assert escape("x" * 20, limit=5) == "xxxxx..."


@given(st.text())
def test_parsers_never_raise(text):
    """Arbitrary text never crashes either parser."""
    parse_cgroup(text)
    parse_config(text)


@given(st.binary())
def test_stat_parser_never_raises_and_escape_is_always_printable(data):
    """Arbitrary bytes never crash the stat reader, and escaping them always gives printable text."""
    from pvegpu.adapters.procstat import parse_stat
    from pvegpu.core.safetext import escape

    parse_stat(data)
    parse_cgroup(data)
    assert escape(data).isprintable()


def test_settings_collect_every_problem(tmp_path):
    """A broken settings file, an unknown key and a bad value are all reported in one ConfigError (exit 2)."""
    import pytest

    from pvegpu.adapters.settingsfile import load
    from pvegpu.core.errors import ConfigError

    bad = tmp_path / "bad.toml"
    bad.write_text("[reset\n")
    bad.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(ConfigError, match="bad.toml") as exc:
        load(str(bad), env={})
    assert exc.value.exit_code == 2
    good = tmp_path / "x.toml"
    good.write_text("[reset]\ngrace = 3\nnope = 1\n[gate]\non_unknown = \"maybe\"\n")
    good.chmod(0o644)  # a settings file is refused when others may write it: never the umask's choice
    with pytest.raises(ConfigError) as exc:
        load(str(good), env={"PVEGPU_RESET_ROUNDS": "0"})
    msg = exc.value.message
    assert "reset.nope: unknown setting" in msg and "gate.on_unknown" in msg and "reset.rounds" in msg


def test_nvml_missing_library_is_unknown(monkeypatch):
    """Without libnvidia-ml, NVML's reader (nvidia-ml-py) raises GpuQueryError (unknown), never reports zero."""
    import pynvml
    import pytest

    from pvegpu.adapters.nvml import NvmlProbe
    from pvegpu.core.errors import GpuQueryError

    def missing(*a, **kw):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(pynvml, "nvmlLib", None)  # not loaded yet, as in a fresh process
    monkeypatch.setattr(pynvml, "CDLL", missing)
    with pytest.raises(GpuQueryError, match="(?i)library not found") as exc:
        NvmlProbe()
    assert exc.value.exit_code == 5
